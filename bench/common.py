"""Shared measurement helpers for the GPU benchmarks (each script prints one JSON object)."""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from teratrain.config import load_config  # noqa: E402
from teratrain.metrics import peak_flops  # noqa: E402


# NVLink multicast off for every job of these benchmarks (NCCL, PyTorch's symmetric memory, NVSHMEM)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROOT = Path(__file__).resolve().parents[1]


def job_env(**extra: str) -> dict:
    """The environment of a process these benchmarks start: multicast off, the checkout importable."""
    return {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **extra}


def torchrun(script: str | Path, nproc: int, args: list[str], timeout_s: int = 3600) -> None:
    """`script args` on `nproc` local processes under torchrun, from the checkout; raises if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    subprocess.run(cmd, check=True, env=job_env(), timeout=timeout_s, cwd=ROOT)


def in_job(fn, *args) -> None:
    """fn(*args) as one rank of a torchrun job these benchmarks started, then the process groups shut
    down before exit (a live group is freed in teardown, where its threads abort)."""
    from teratrain.mesh import shutdown

    fn(*args)
    shutdown()


def hf_llama(m, dev: torch.device):
    """transformers' LlamaForCausalLM (attention sdpa, untied head, no biases) at the shape of teratrain's
    model config `m`, in training mode on `dev`: the peer of bench/train_step.py and bench/fp8.py."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(hidden_size=m.d_model, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers,
                         num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
                         max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_cfg).to(dev).train()


def hf_gpt2(m, dev: torch.device):
    """transformers' GPT2LMHeadModel (attention sdpa, the head tied) at the shape of teratrain's GPT-2 config `m`,
    from the keys teratrain's export writes (checkpoint/hf_config.py to_hf), in training mode on `dev`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from teratrain.checkpoint.hf_config import to_hf

    hf_cfg = GPT2Config(**{k: v for k, v in to_hf(m).items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(hf_cfg).to(dev).train()


def torchao_float8(model, cfg, tp: int = 1, **options):
    """torchtitan's float8 training on a peer's side: torchao's `convert_to_float8_training` swaps for its
    Float8Linear exactly the linears teratrain runs in float8 (memory/fp8.py `float8_weights`: the block linears
    outside MoE layers, not the embedding, not the head) whose local weight torch._scaled_mm takes (`aligned`),
    with the recipe of memory.fp8 and, under memory.fp8_emulate, torchao's high-precision emulation of the float8
    GEMMs (CPU). `tp`: the ranks torchtitan's tensor-parallel plan splits each weight over (rowwise wo and w2 by
    columns, the others colwise by rows); `options`: more fields of the Float8LinearConfig (FSDP2's
    `enable_fsdp_float8_all_gather`). Returns the Float8LinearConfig used."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from teratrain.memory.fp8 import aligned, float8_weights

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.memory.fp8), emulate=cfg.memory.fp8_emulate,
                                 **options)
    block = {id(w) for w in float8_weights(model)}

    def local(fqn: str, d_out: int, d_in: int) -> tuple[int, int]:  # the plan's split: rowwise wo, w2; else colwise
        return (d_out, d_in // tp) if fqn.rsplit(".", 1)[-1] in ("wo", "w2") else (d_out // tp, d_in)

    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: id(
        getattr(mod, "weight", None)) in block and aligned(local(fqn, *mod.weight.shape)))
    return config


def add_weights_arg(ap) -> None:
    """`--weights`: fp32 weights, or bf16 weights with fp32 masters on both sides (`weights_set`)."""
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: bf16 weights with fp32 masters in the optimizer on both sides (memory.master_weights)")


def weights_set(weights: str) -> str:
    """The config setting of `--weights`."""
    return f"memory.master_weights={str(weights == 'bf16').lower()}"


def hf_step(model, cfg, dev: torch.device, accum: int = 1):
    """A training step of transformers' model `model` on (x, x) (it shifts the labels itself): `accum`
    micro-batches, clipping, AdamW, as the bench's teratrain rows step. With `memory.master_weights` the
    model's weights become bf16 and teratrain's engine steps fp32 masters, as on teratrain's side; else
    torch's fused AdamW steps the fp32 weights. Returns (step, what must stay alive)."""
    from teratrain.memory.precision import autocast
    from teratrain.optim.engine import LocalEngine

    if cfg.memory.master_weights:
        keep = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, master_weights=True)
        backward, update = keep.backward, lambda: keep.step(cfg.optim.lr)
    else:
        keep = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                 weight_decay=cfg.optim.weight_decay, fused=dev.type == "cuda")

        def update():
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            keep.step()
            keep.zero_grad(set_to_none=True)
        backward = torch.Tensor.backward

    def step(x, y):
        for _ in range(accum):
            with autocast("bf16", dev):
                loss = model(input_ids=x, labels=x).loss
            backward(loss / accum)
        update()
        return loss.item()

    return step, (model, keep)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def fresh_compile() -> None:
    """Before a run: forget the earlier runs' compiled code and CUDA graphs (each would count
    towards dynamo's recompile limit, 8 per function, past which it runs eager without a word) and
    zero dynamo's counters, so `graph_breaks` reports this run alone."""
    from torch._dynamo.utils import counters

    from teratrain.compat import release_compiled

    release_compiled()
    counters.clear()


def smoke_compile() -> None:
    """torch.compile and nn.Module.compile with the aot_eager backend for the rest of this process: a
    --smoke run traces the graphs as the GPU runs do and runs them eagerly (inductor would compile C++
    for minutes on 2 cores)."""
    compile_fn, compile_module = torch.compile, torch.nn.Module.compile
    torch.compile = lambda *a, **kw: compile_fn(*a, **{**kw, "backend": "aot_eager"})
    torch.nn.Module.compile = lambda self, **kw: compile_module(self, **{**kw, "backend": "aot_eager"})


def graph_breaks() -> dict:
    """The graph breaks since `fresh_compile`: their count, the compiled graphs, the top 5 reasons. Every
    break is a return to Python the host pays on each step."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"count": sum(breaks.values()), "graphs": counters["stats"]["unique_graphs"],
            "reasons": dict(sorted(breaks.items(), key=lambda kv: -kv[1])[:5])}


def fresh_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


class GpuClocks:
    """The GPU's SM clock (MHz), board power (W) and temperature sampled by nvidia-smi every `ms` while the
    block runs, for GPU `index`. `summary()`: medians (and the extremes) over the samples that found the GPU busy
    (utilization >= 90%), so a step paced by its power limit shows the clock it ran at, next to the card's
    maximum clock and power limit. Not `enabled` (a CPU run), or without nvidia-smi, the summary is empty."""

    QUERY = "clocks.sm,power.draw,temperature.gpu,utilization.gpu"

    def __init__(self, index: int = 0, ms: int = 100, enabled: bool = True):
        self.index, self.ms, self.enabled, self.proc, self.lines = index, ms, enabled, None, []

    def __enter__(self):
        if not self.enabled:
            return self
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--id={self.index}", f"--query-gpu={self.QUERY}",
                                          "--format=csv,noheader,nounits", f"-lms={self.ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.lines = self.proc.communicate(timeout=10)[0].splitlines()
        return False

    def summary(self) -> dict:
        rows = []
        for line in self.lines:
            try:
                row = [float(v) for v in line.split(",")]
            except ValueError:
                continue  # a field the card does not report ("[N/A]")
            if len(row) == 4:
                rows.append(row)
        busy = [r for r in rows if r[3] >= 90]
        if not busy:
            return {}

        def med(i: int) -> float:
            return round(statistics.median(r[i] for r in busy), 1)

        return {"sm_mhz": med(0), "sm_mhz_min": min(r[0] for r in busy), "power_w": med(1),
                "power_w_max": max(r[1] for r in busy), "temp_c": med(2), "busy_samples": len(busy),
                "samples": len(rows), **card_limits(self.index)}


def card_limits(index: int = 0) -> dict:
    """The card's maximum SM clock (MHz) and power limit (W), as nvidia-smi reports them; {} without it."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=clocks.max.sm,power.limit",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        mhz, watts = (float(v) for v in out.strip().split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return {"sm_mhz_max": mhz, "power_limit_w": watts}


def time_steps(step, warmup: int, steps: int, dev: torch.device) -> list[float]:
    """Wall time of each of `steps` calls of step() after `warmup` untimed ones (synchronized)."""
    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def summarize(times: list[float], tokens_per_step: int, flops_per_token: float, dev: torch.device,
              precision: str = "bf16") -> dict:
    """Median step time -> tokens/s, achieved TFLOP/s (PaLM model FLOPs) and MFU."""
    step_s = statistics.median(times)
    tps = tokens_per_step / step_s
    tflops = tps * flops_per_token / 1e12
    peak = peak_flops(dev, precision, None)
    return {"step_ms": round(step_s * 1e3, 2), "step_ms_spread": round((max(times) - min(times)) * 1e3, 2),
            "tokens_per_s": round(tps, 1), "tflops": round(tflops, 2),
            "mfu": round(tflops * 1e12 / peak, 4) if peak else None, "peak_gib": _r(peak_gib(dev))}


def _r(x):
    return round(x, 2) if x is not None else None


def config(overrides: list[str]):
    return load_config(None, overrides)


def planner_card(dev: torch.device) -> str:
    """The planner's preset of the card `dev` is (h200, a100, else h100); h200 off a GPU."""
    if dev.type != "cuda":
        return "h200"
    name = torch.cuda.get_device_name(dev)
    return "h200" if "H200" in name else "a100" if "A100" in name else "h100"


def env_info(dev: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def count_ops(step, also=None):
    """The aten ops one call of `step` dispatches (what planner/time.py's op counts count); with `also` (a
    predicate on an op), (all ops, those it holds for)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = hits = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            self.hits += also is not None and bool(also(func))
            return func(*args, **(kwargs or {}))

    with Count() as c:
        step()
    return c.n if also is None else (c.n, c.hits)


def error_text(e: BaseException) -> str:
    """An exception as a result row records it: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__


def emit(obj: dict, out: str | None = None) -> None:
    text = json.dumps(obj, indent=1)
    print(text, flush=True)
    if out:
        Path(out).write_text(text)


def gpu_memory_bytes() -> int:
    """Total memory of GPU 0, asked in a short-lived process, so a driver that launches torchrun
    jobs holds no CUDA context on a GPU its children use."""
    import subprocess

    code = "import torch; print(torch.cuda.mem_get_info(0)[1])"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _planned(sets: list[str], dp: int):
    """(shape, training, layout, memory) of the layout of `sets` at data-parallel degree `dp`, as planned."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import plan_memory

    cfg = config(sets + [f"parallel.dp={dp}"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, dp)
    return shape, train, lay, plan_memory(shape, train, lay)


def planned_bytes(sets: list[str], dp: int) -> int:
    """The memory one GPU needs for the layout of `sets` at data-parallel degree `dp`, as teratrain's
    planner predicts it (peak allocated plus its allowance for the CUDA context and fragmentation)."""
    return _planned(sets, dp)[3].total


def planned_step(sets: list[str], card: str, dp: int = 1) -> tuple[float, float]:
    """(seconds of one optimizer step, peak allocated GiB) of the layout of `sets` at data-parallel degree `dp`,
    as teratrain's planner predicts them with the preset of `card` (planner/hardware.py GPUS)."""
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.time import plan_time

    shape, train, lay, mem = _planned(sets, dp)
    return plan_time(shape, train, lay, GPUS[card], mem).step_time_s, mem.peak_allocated / 2**30


def fit_layers(sets: list[str], dp: int, total_bytes: int, fraction: float = 0.75) -> int:
    """The most blocks (up to the shape's own) whose planned memory (planned_bytes) fits `fraction`
    of `total_bytes` (the rest: room for allocator fragmentation and a peer's own buffers)."""
    for n in range(config(sets).model.n_layers, 0, -1):
        if planned_bytes(sets + [f"model.n_layers={n}"], dp) <= fraction * total_bytes:
            return n
    raise SystemExit(f"not one block of {sets} fits {fraction:.0%} of {total_bytes / 2**30:.0f} GiB at dp={dp}")
