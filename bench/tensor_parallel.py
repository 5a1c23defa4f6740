"""Our Megatron tensor parallelism against PyTorch's DTensor tensor parallelism (torchtitan's plan:
colwise/rowwise linears, `SequenceParallel` norms, `loss_parallel`, an optimizer stepping DTensors)
and against one GPU, on the same model, shape and tokens, in one run: tokens/s, TFLOP/s per GPU,
per-GPU efficiency against one GPU in the same mode (`per_gpu_efficiency_same_mode`: eager against
eager, compiled against compiled, CUDA graphs against CUDA graphs), peak memory; with and without
sequence parallelism; plus NCCL loss parity of our tp against one GPU (bf16). Two shapes: the
llama-8b width (n_layers sized so one GPU holds the model) and the llama-1b width (8 layers, seq 2048,
micro-batch 2).

    torchrun --nproc-per-node 2 bench/tensor_parallel.py --out tp.json
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --profile    # + a trace summary per variant
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --smoke      # gloo CPU, tiny shapes
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --compile --fp8 tensorwise   # + each in float8
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --smoke --fp8 tensorwise     # float8 GEMMs emulated

Both sides: bf16 autocast over fp32 weights, AdamW built by teratrain's `build_optimizer` (fused
where the device allows: on CPU too, so the smoke run steps the DTensor parameters exactly as the GPU
run does), gradient clipping at 1.0 with the norm read back every step. One GPU: every rank runs the
unsplit model on its own device at the same time (no communication); rank 0's figures are reported.
`--fp8 RECIPE`: every variant and one GPU once more per mode with the block linears in float8 (ours:
memory.fp8=RECIPE; DTensor: torchtitan's torchao float8 training, common.py `torchao_float8`), rows
NAME_fp8 whose per-GPU efficiency is against one GPU in float8, each with `fp8_over_bf16_same_mode` (its
tokens/s over its bf16 row's, same variant and mode), gathered at the top under that name with each row's
mode and, for ours, the target at the llama-8b width (1.2x); `ours_vs_dtensor_*_fp8*`: both sides float8.
A variant memory.fp8 does not take (tp_overlap=chunked) is listed in its shape's `fp8_not_run` with the
reason; --smoke emulates the float8 GEMMs (memory.fp8_emulate, torchao's emulate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, env_info, error_text, fresh_compile, fresh_memory, graph_breaks, peak_gib, sync, torchao_float8
from trace_summary import profile_steps  # noqa: E402

from teratrain.config import load_config  # noqa: E402
from teratrain.config_base import ConfigError  # noqa: E402
from teratrain.memory.fp8 import RECIPES, fp8_problem  # noqa: E402
from teratrain.memory.precision import autocast  # noqa: E402
from teratrain.mesh import Runtime, init_runtime, shutdown  # noqa: E402
from teratrain.metrics import peak_flops  # noqa: E402
from teratrain.models.transformer import Transformer, flops_per_token, init_param_  # noqa: E402
from teratrain.optim.build import build_optimizer  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.parallel.parallelize import parallelize  # noqa: E402

# name -> (model overrides, micro-batch, most blocks: sized down to what one GPU holds)
SHAPES = {"llama8b_width": (["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"], 1, 8),
          # untied head on both sides: torchtitan's Llama (the DTensor plan) has an `output` linear of its own
          "llama1b_width": (["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048",
                             "model.tie_embeddings=false"], 2, 8)}
SMOKE = {"tiny": (["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=128",
                   "model.seq_len=32", "model.vocab_size=512"], 2, 2)}
COMMON = ["memory.precision=bf16", "train.grad_clip=1.0"]
# --compile's modes: train.compile_mode -> the suffix of the rows it measures
MODE_TAGS = {"default": "_compiled", "reduce-overhead": "_graphed", "max-autotune-no-cudagraphs": "_autotuned"}
# name -> (implementation, overrides of the tp run)
CHUNKED = ["parallel.tp_overlap=chunked"]
ASYNC = ["parallel.tp_overlap=async"]
COMPILED_ONLY = ("train.compile_overlap=true", ASYNC[0])  # settings of compiled code
VARIANTS = {"ours_no_sp": ("ours", ["parallel.sequence_parallel=false"]),
            "ours_sp": ("ours", ["parallel.sequence_parallel=true"]),
            "ours_no_sp_chunked2": ("ours", ["parallel.sequence_parallel=false"] + CHUNKED),
            "ours_sp_chunked2": ("ours", ["parallel.sequence_parallel=true"] + CHUNKED),
            "ours_sp_chunked4": ("ours", ["parallel.sequence_parallel=true", "parallel.tp_overlap_chunks=4"] + CHUNKED),
            # train.compile_overlap: inductor's collective reordering (compiled modes only)
            "ours_no_sp_reorder": ("ours", ["parallel.sequence_parallel=false", "train.compile_overlap=true"]),
            "ours_sp_reorder": ("ours", ["parallel.sequence_parallel=true", "train.compile_overlap=true"]),
            # PyTorch's async TP: inductor fuses gathers and reduce-scatters with their GEMMs (compiled, CUDA)
            "ours_sp_async": ("ours", ["parallel.sequence_parallel=true"] + ASYNC),
            "dtensor_no_sp": ("dtensor", ["parallel.sequence_parallel=false"]),
            "dtensor_sp": ("dtensor", ["parallel.sequence_parallel=true"])}
SMOKE_PROFILED = ("ours_sp_chunked2", "dtensor_sp")  # --smoke --profile: enough to run the code path
FP8_TARGET = {"llama8b_width": 1.2}  # --fp8: float8 tokens/s over bf16's, same variant and mode (tp=2 and tp=4)
PAIRS = {"no_sp": ("ours_no_sp", "dtensor_no_sp"), "sp": ("ours_sp", "dtensor_sp"),
         "no_sp_chunked2": ("ours_no_sp_chunked2", "dtensor_no_sp"), "sp_chunked2": ("ours_sp_chunked2", "dtensor_sp"),
         "sp_chunked4": ("ours_sp_chunked4", "dtensor_sp")}


def ours(cfg, rt, micro: int = 1):
    """Our step; `micro` > 1 splits the batch into that many micro-batches (gradient accumulation)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)
    return lambda x, y: train_step(model, engine, list(zip(x.chunk(micro), y.chunk(micro))), "bf16", 1e-4)[1]


def dtensor(cfg, rt):
    """torchtitan's plan on the same Transformer class (its attention reads head counts from the
    projections' shapes, so local shards need no change). Every parameter ends up a DTensor on the 1-D
    mesh, the norms' too (Replicate), as the fused optimizer requires all of its tensors to be."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh(rt.device.type, (rt.world,))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if cfg.memory.fp8 != "none":  # torchtitan's order: the float8 linears swapped in, then split
        torchao_float8(model, cfg, rt.world)
    _dtensor_plan(model, mesh, cfg.parallel.use_sp, local=not cfg.train.compile, float8=cfg.memory.fp8)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:  # the fused optimizer (and clipping) would fail on, or mis-handle, a mix
        raise RuntimeError(f"the DTensor plan left plain parameters: {', '.join(plain[:4])}")
    model.to_empty(device=rt.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_param_(p.to_local(), name, cfg.model, 0)  # values differ from ours (sliced per rank): timing only
    model.init_buffers(rt.device)
    opt = build_optimizer(list(model.named_parameters()), cfg.optim)
    if cfg.train.compile:  # torchtitan's: each block compiled on its own
        for block in model.layers:
            block.compile(mode=cfg.train.compile_mode)

    def step(x, y):
        with autocast("bf16", rt.device):
            logits = model(x)
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=True)
        float(norm.full_tensor())  # ours reads its norm back every step too
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _dtensor_plan(model, mesh, sp: bool, local: bool = True, float8: str = "none") -> None:
    """torchtitan's plan. `local`: the residual stream between the split regions as plain local tensors
    (torchtitan's, eager); else kept a DTensor, as compiled blocks need: with plain tensors between them
    their backward fails (bench/dtensor_compile_repro.py). Without SP it fails compiled either way: kept a
    DTensor, the embedding's backward redistributes a Partial(sum) gradient to its MaskPartial, which
    DTensor does not support (torch 2.13). `float8=tensorwise`: torchtitan's float8 styles (torchao): with
    SP, each region's input cast to float8 before its all-gather, and its output gradient before the exit's
    backward all-gather; gloo all-gathers no float8 tensor ("Invalid scalar type"), so on CPU with SP the
    entries and exits keep the plain styles (bf16 gathers, float8 GEMMs). rowwise: the plain styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sp else Replicate()
    norm = SequenceParallel if sp else None
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8 == "tensorwise":
        from torchao.float8 import float8_tensor_parallel as ao

        colwise = ao.Float8ColwiseParallel
        if mesh.device_type == "cuda" or not sp:  # else gloo: the plain entry and exit (the docstring)
            rowwise, prepare = ao.Float8RowwiseParallel, ao.PrepareFloat8ModuleInput
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=local),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = {"attention.wq": colwise(), "attention.wk": colwise(), "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=seq, use_local_output=local),
                "feed_forward.w1": colwise(), "feed_forward.w3": colwise(),
                "feed_forward.w2": rowwise(output_layouts=seq, use_local_output=local),
                # one entry per region: its gradient is reduced once, not once per projection
                "attention": prepare(input_layouts=(seq, None, None, None),
                                     desired_input_layouts=(Replicate(), None, None, None)),
                "feed_forward": prepare(input_layouts=(seq,), desired_input_layouts=(Replicate(),))}
        if norm:
            plan.update({"attention_norm": norm(), "ffn_norm": norm()})
        parallelize_module(block, mesh, plan)
    if not sp:  # whole norms on every rank
        for module in [model.norm] + [m for b in model.layers for m in (b.attention_norm, b.ffn_norm)]:
            _replicate(module, mesh, local)


def _replicate(module, mesh, local: bool) -> None:
    """Whole norms on every rank: Replicate weights; plain tensors in and out where `local`, else DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def enter(mod, inputs, mesh):
        return tuple(t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     for t in inputs)

    distribute_module(module, mesh, input_fn=enter, output_fn=lambda mod, out, mesh: out.to_local() if local else out)


def one_gpu(cfg, rt):
    return ours(cfg, Runtime.single(rt.device))


def measure(step, cfg, rt, mb: int, warmup: int, steps: int, world: int) -> dict:
    """Median step time of one tp group (every rank sees the same tokens) over `world` GPUs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=g).to(rt.device)
    times = []
    for i in range(warmup + steps):
        sync(rt.device)
        dist.barrier()
        t0 = time.perf_counter()
        step(x[:, :-1], x[:, 1:])
        sync(rt.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tps = mb * cfg.model.seq_len / statistics.median(times)
    tflops = tps * flops_per_token(cfg.model) / world / 1e12
    peak = peak_flops(rt.device, "bf16", None)
    mem = peak_gib(rt.device)
    return {"tokens_per_s": round(tps, 1), "tflops_per_gpu": round(tflops, 2),
            "mfu": round(tflops * 1e12 / peak, 4) if peak else None,
            "step_ms": round(1e3 * statistics.median(times), 2),
            "peak_gib": round(mem, 2) if mem else None}


def fitting_layers(base: list[str], mb: int, most: int, device: torch.device) -> int:
    """The most blocks (up to `most`) whose one-GPU run the planner fits in 85% of this GPU's memory."""
    if device.type != "cuda":
        return most
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import plan_memory

    total = torch.cuda.mem_get_info(device)[1]
    for n in range(most, 0, -1):
        cfg = load_config(None, base + COMMON + [f"model.n_layers={n}", f"train.micro_batch={mb}",
                                                 f"train.global_batch={mb}"])
        if plan_memory(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), GPUS["h100"]).total <= 0.85 * total:
            return n
    raise SystemExit("not even one block of this shape fits on one GPU of this machine")


def run_shape(base: list[str], mb: int, rt, args, keep) -> dict:
    """Every variant of one shape, in bf16 and, with --fp8, again with the block linears in float8 (rows
    NAME_fp8[mode tag], one GPU's included); `keep(out)` after each, so a run cut short keeps what it
    measured."""
    warmup, steps = (1, 2) if args.smoke else (3, args.steps)
    out = {"shape": base, "micro_batch": mb}
    profiled = lambda name: args.profile and (not args.smoke or name in SMOKE_PROFILED)  # noqa: E731

    def measured(build, cfg, name: str, world: int) -> dict:
        return _run(build, cfg, rt, mb, warmup, steps, world, profiled(name))

    batch = [f"train.micro_batch={mb}", f"train.global_batch={mb}"]  # what a step runs (async TP sizes on it)
    precisions = [("", [])] + ([("_fp8", fp8_settings(args))] if args.fp8 else [])
    for mode in [None] + (args.compile or []):
        compiled, tag = mode is not None, MODE_TAGS.get(mode, "")
        for kind, precision in precisions:
            extra_all = (["train.compile=true", f"train.compile_mode={mode}"] if compiled else []) + precision
            one = "one_gpu" + kind + tag
            out[one] = measured(one_gpu, load_config(None, base + COMMON + batch + extra_all), one, 1)
            _variants(out, base + COMMON + batch, extra_all, kind, tag, rt, args, measured, keep)
            if compiled:
                out[one]["vs_eager"] = round(out[one]["tokens_per_s"] / out["one_gpu" + kind]["tokens_per_s"], 4)
    for tag, (a, b) in PAIRS.items():  # like for like: the same mode, and both bf16 or both float8
        for c in [kind + mode for kind, _ in precisions for mode in ("",) + tuple(MODE_TAGS.values())]:
            if "tokens_per_s" in out.get(a + c, {}) and "tokens_per_s" in out.get(b + c, {}):
                out[f"ours_vs_dtensor_{tag}{c}"] = round(out[a + c]["tokens_per_s"] / out[b + c]["tokens_per_s"], 4)
    return out


def _variants(out: dict, sets: list[str], extra_all: list[str], kind: str, tag: str, rt, args, measured,
              keep) -> None:
    """The tp variants of one mode (`tag`) and precision (`kind`: "" bf16, "_fp8"), each against the one-GPU
    run of the same mode and precision; a float8 row also against its bf16 row of the same mode. A variant
    whose settings memory.fp8 does not take (tp_overlap=chunked) is listed in `fp8_not_run` with the reason."""
    compiled, one = bool(tag), "one_gpu" + kind + tag
    for name, (impl, extra) in VARIANTS.items():
        if (args.variants and name not in args.variants) or (compiled and name == "dtensor_no_sp"):
            continue  # compiled, DTensor without SP fails in backward either way (_dtensor_plan)
        if (not compiled and any(o in extra for o in COMPILED_ONLY)) or (ASYNC[0] in extra and args.smoke):
            continue  # a setting of compiled code; async TP needs CUDA symmetric memory
        try:
            cfg = load_config(None, sets + [f"parallel.tp={rt.world}"] + extra + extra_all)
        except ConfigError as e:
            if not kind:
                raise
            out.setdefault("fp8_not_run", {})[name + tag] = str(e)
            continue
        try:
            row = out[name + kind + tag] = measured(ours if impl == "ours" else dtensor, cfg, name + kind + tag,
                                                    rt.world)
        except Exception as e:  # noqa: BLE001 - DTensor's compiled or float8 form: recorded as it failed, run on
            if impl == "ours" or not (compiled or kind):
                raise
            out[name + kind + tag] = {"error": error_text(e)}
            keep(out)
            continue
        row.update(against_one_gpu(row, out[one], out["one_gpu" + kind], rt.world))
        if compiled:  # the same layout, eager in the same run: what compiling is worth to each
            plain = name.removesuffix("_reorder").removesuffix("_async")
            eager = out.get(plain + kind)  # their eager run: the plain one, in the same precision
            if eager:
                row["vs_eager"] = round(row["tokens_per_s"] / eager["tokens_per_s"], 4)
        if kind and "tokens_per_s" in out.get(name + tag, {}):  # float8 against bf16, same variant, same mode
            row["fp8_over_bf16_same_mode"] = round(row["tokens_per_s"] / out[name + tag]["tokens_per_s"], 4)
        keep(out)


def fp8_settings(args) -> list[str]:
    """--fp8's settings: memory.fp8 at the recipe; on CPU (--smoke) the float8 GEMMs emulated in high precision."""
    return [f"memory.fp8={args.fp8}"] + (["memory.fp8_emulate=true"] if args.smoke else [])


def mode_of(name: str) -> str:
    """A row's mode from its name: eager, or the train.compile_mode its suffix stands for (MODE_TAGS)."""
    return next((mode for mode, tag in MODE_TAGS.items() if name.endswith(tag)), "eager")


def against_one_gpu(row: dict, one_same_mode: dict, one_eager: dict, world: int) -> dict:
    """A tp row against one GPU: `per_gpu_efficiency_same_mode` (the headline: one GPU run in the row's own
    mode, `one_same_mode`), and where the row is compiled also against the eager one GPU, named as such."""
    speedup = row["tokens_per_s"] / one_same_mode["tokens_per_s"]
    out = {"speedup_same_mode": round(speedup, 4), "per_gpu_efficiency_same_mode": round(speedup / world, 4)}
    if one_same_mode is not one_eager:
        out["per_gpu_efficiency_vs_eager_one_gpu"] = round(row["tokens_per_s"] / one_eager["tokens_per_s"] / world, 4)
    return out


def headline(shapes: dict) -> dict:
    """Per shape, every tp row's per-GPU efficiency against one GPU in the same mode, with that mode."""
    return {shape: {name: {"mode": mode_of(name), "per_gpu_efficiency_same_mode": row["per_gpu_efficiency_same_mode"]}
                    for name, row in rows.items() if isinstance(row, dict) and "per_gpu_efficiency_same_mode" in row}
            for shape, rows in shapes.items()}


def fp8_headline(shapes: dict, recipe: str) -> dict:
    """Per shape, every float8 tp row's tokens/s over its bf16 row (same variant, same mode), with that mode,
    and where the shape has one, the target and whether the row meets it (FP8_TARGET)."""
    out = {}
    for shape, rows in shapes.items():
        target = FP8_TARGET.get(shape)  # ours only: DTensor's rows are listed for comparison
        out[shape] = {name: {"mode": mode_of(name), "recipe": recipe, "fp8_over_bf16_same_mode": r}
                      | ({"target": target, "met": r >= target} if target and name.startswith("ours") else {})
                      for name, row in rows.items() if isinstance(row, dict)
                      and (r := row.get("fp8_over_bf16_same_mode")) is not None}
    return out


def _run(build, cfg, rt, mb, warmup, steps, world, profile: bool) -> dict:
    if rt.rank == 0:  # where a run cut short by a time limit stopped
        print(f"[tp] tp={world} compile={cfg.train.compile} sp={cfg.parallel.use_sp if world > 1 else None} "
              f"fp8={cfg.memory.fp8} at {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    # release first: a previous run's CUDA graph pools stay allocated until released, and a peak
    # reset while they are alive counts them in this run's peak
    fresh_compile()
    fresh_memory(rt.device)
    with fused_ops() as fused:
        step = build(cfg, rt)
        row = measure(step, cfg, rt, mb, warmup, steps, world)
    if cfg.train.compile:
        row["graph_breaks"] = graph_breaks()
        row["comm_reorder_passes"] = list(torch._inductor.config.reorder_for_compute_comm_overlap_passes)
        if cfg.parallel.tp_overlap == "async":
            row["async_tp"] = fused
    if profile:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=g).to(rt.device)
        row["profile"] = profile_steps(lambda: step(x[:, :-1], x[:, 1:]), rt.device)
    del step
    fresh_memory(rt.device)
    dist.barrier()
    return row


@contextlib.contextmanager
def fused_ops():
    """{graphs, fused_all_gather_matmul, fused_matmul_reduce_scatter}: what inductor's async-TP pass
    leaves in the graphs compiled within (it runs where tp_overlap=async). graphs = 0: inductor's
    cache served the compiled graphs and no pass ran, so nothing was counted."""
    from torch._inductor.fx_passes import post_grad

    counts = {"graphs": 0, "fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}
    original = post_grad.micro_pipeline_tp_pass

    def counting(graph):
        original(graph)
        counts["graphs"] += 1
        for node in graph.nodes:
            for key in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
                counts[key] += key in str(node.target)

    post_grad.micro_pipeline_tp_pass = counting
    try:
        yield counts
    finally:
        post_grad.micro_pipeline_tp_pass = original


PARITY_BATCH = ["train.micro_batch=1", "train.global_batch=2"]  # a parity step: 2 micro-batches of 1 sequence


def parity(base: list[str], rt, steps: int, modes: list[str]) -> dict:
    """Losses of our tp run, plain and overlapped (SP on), eager and under each --compile mode, against the same
    model on one device (rank 0 alone, eager, bf16). Each step accumulates 2 micro-batches of 1
    sequence: a CUDA graph replay (reduce-overhead) overwrites what the previous one returned, so the
    accumulation is what a graphed step can get wrong."""
    g = torch.Generator().manual_seed(1)
    vocab, T = load_config(None, base).model.vocab_size, load_config(None, base).model.seq_len
    batches = [torch.randint(0, vocab, (2, T + 1), generator=g).to(rt.device) for _ in range(steps)]
    runs = {"tp": [], "tp_chunked": CHUNKED}
    runs.update({"tp" + MODE_TAGS[m]: ["train.compile=true", f"train.compile_mode={m}"] for m in modes})
    runs.update({"tp_chunked" + MODE_TAGS[m]: CHUNKED + ["train.compile=true", f"train.compile_mode={m}"]
                 for m in modes})
    if rt.device.type == "cuda":  # async TP: symmetric memory
        runs.update({"tp_async" + MODE_TAGS[m]: ASYNC + ["train.compile=true", f"train.compile_mode={m}"]
                     for m in modes})
    out = {}
    for tag, extra in runs.items():
        fresh_compile()  # else dynamo reuses the previous run's graphs for this model's blocks, whatever changed
        with fused_ops() as fused:
            step = ours(load_config(None, base + COMMON + PARITY_BATCH + [f"parallel.tp={rt.world}"] + extra), rt,
                        micro=2)
            out[f"{tag}_losses"] = [float(step(b[:, :-1], b[:, 1:])) for b in batches]
        if ASYNC[0] in extra:
            out[f"{tag}_fused"] = fused
        del step
    if rt.rank == 0:
        ref = ours(load_config(None, base + COMMON + PARITY_BATCH), Runtime.single(rt.device), micro=2)
        out["one_gpu_losses"] = [float(ref(b[:, :-1], b[:, 1:])) for b in batches]
        for tag in runs:
            out[f"{tag}_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(out[f"{tag}_losses"],
                                                                                 out["one_gpu_losses"]))
        del ref
    fresh_memory(rt.device)
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (after 3 warm-up steps)")
    ap.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="default: both")
    ap.add_argument("--profile", action="store_true", help="add a torch.profiler summary of 2 steps per variant")
    ap.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny shapes")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated subset of {','.join(VARIANTS)} (one GPU always runs); default all")
    ap.add_argument("--compile", nargs="?", const="default", type=lambda s: s.split(","), default=None,
                    help="run each variant and one GPU once more per train.compile_mode given (comma-separated; "
                         "default: default), reported as NAME_compiled / _graphed (reduce-overhead) / _autotuned "
                         "with vs_eager; one GPU runs in every mode too, and each tp row's "
                         "per_gpu_efficiency_same_mode is against the one-GPU run of its own mode (DTensor compiled: "
                         "with SP only, each block compiled, its residual stream kept a DTensor; a failure is "
                         "recorded in its row: bench/dtensor_compile_repro.py)")
    ap.add_argument("--fp8", choices=RECIPES, help="also every variant and one GPU with the block linears in float8 "
                                                   "at this recipe (ours memory.fp8, DTensor torchao's float8 "
                                                   "training): rows NAME_fp8, each with fp8_over_bf16_same_mode")
    ap.add_argument("--no-parity", action="store_true", help="skip the loss check against one GPU")
    ap.add_argument("--parity-only", action="store_true", help="only the loss check (no timed variants)")
    args = ap.parse_args()
    unknown = set(args.variants or ()) - set(VARIANTS)
    if set(args.compile or ()) - set(MODE_TAGS):
        ap.error(f"unknown --compile mode in {args.compile}; choose from {', '.join(MODE_TAGS)}")
    if unknown:
        ap.error(f"unknown --variants {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rt = init_runtime(load_config(None, [f"parallel.tp={world}"] + (["train.device=cpu"] if args.smoke else [])))
    why = fp8_problem(args.fp8 or "none", args.smoke, rt.device)
    if why:
        raise SystemExit(why)
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in (args.shapes or SHAPES)}
    result = {"tp": rt.world, "env": env_info(rt.device), "shapes": {}}
    for name, (base, mb, most) in shapes.items():
        layers = min(fitting_layers(base + extra, mb, most, rt.device)  # the float8 runs hold the same blocks
                     for extra in ([], fp8_settings(args) if args.fp8 else []))

        def keep(partial: dict, name=name) -> None:
            result["shapes"][name] = partial
            if rt.rank == 0 and args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
        if not args.parity_only:
            keep(run_shape(base + [f"model.n_layers={layers}"], mb, rt, args, keep))
    small = next(iter(shapes.values()))[0] + ["model.n_layers=2"]
    if not args.no_parity:
        result["parity"] = parity(small + ([] if args.smoke else ["model.seq_len=1024"]), rt, 3 if args.smoke else 8,
                                  args.compile or [])
    result["per_gpu_efficiency_same_mode"] = headline(result["shapes"])
    if args.fp8:
        result["fp8_over_bf16_same_mode"] = fp8_headline(result["shapes"], args.fp8)
    if rt.rank == 0:
        emit(result, args.out)
    shutdown()


if __name__ == "__main__":
    main()
