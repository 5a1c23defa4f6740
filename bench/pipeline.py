"""Pipeline schedules on every GPU of one host (pp = GPU count, dp = tp = 1), in one torchrun job,
sized to the GPU it finds.

    python bench/pipeline.py --profile            # launches itself on every GPU (>= 2); ~4 min on 2
    torchrun --nproc-per-node=N bench/pipeline.py # the same without the profile, launched by hand
    python bench/pipeline.py --smoke              # 2 CPU processes over gloo, tiny shapes: checks the script
    python bench/pipeline.py --parity-only        # NCCL parity of 1F1B, interleaved 1F1B, ZB-H1 vs 1 GPU

Model: a Llama of llama-1b's width (d 2048, 32 heads, 8 KV heads, d_ff 8192, 32k vocab), seq 2048,
micro-batch 2, bf16 autocast over fp32 weights, no recomputation. Its depth comes from the planner
(`size_to_gpu`): the most layers, a multiple of 2 pp (interleaved chunks split evenly), whose
largest schedule (GPipe at m = 16: every micro-batch's activations held) teratrain/planner/memory.py
plans within 90% of the memory torch.cuda.mem_get_info reports, so an H100 (80 GB) and an H200
(141 GB) each run the deepest model they hold.

Measured, for GPipe, 1F1B, interleaved 1F1B (v=2) and ZB-H1 at m = 4, 8, 16 (one model per schedule):
- tokens/s: the median wall time of whole steps (the engine's update included), untimed inside,
  after `--warmup` steps, as many as fit `--seconds` (3 to `--steps`); peak_gib: the fullest rank's
  torch.cuda.max_memory_allocated over them, beside the planner's planned_gib (peak + allowance);
  alloc_retries: the allocator's cache flushes (a synchronizing cudaFree: memory too tight);
- bubble_measured: from three more steps timed per action (CUDA events on the compute stream, ranks
  aligned by a barrier), the idle share of pp x (first start .. last end) of the median one (one
  timed step alone can let a stall on one rank read as bubble; bubbles_timed lists all three);
  bubble_simulated: the
  simulator (parallel/pipeline/simulate.py) on the same schedule fed with that step's per-stage
  median action times and per-boundary transfer times (timing.py; `transfer_ms`), bubble_ratio =
  measured / simulated (target within 10%), bubble_simulated_no_comm: the same without transfers;
- stage_ms: per stage and action kind, the median device ms and the host ms to issue it.
Derived:
- zb_vs_1f1b: ZB-H1's tokens/s and peak memory over 1F1B's at each m (targets on 4 GPUs at m = 8:
  >= 1.05 and <= 1.10), and per stage what the split backward costs: (I + W) / B, device and host
  (stage 0 runs whole backwards: its input gradient goes nowhere, runtime.py);
- one_gpu, one_f_one_b_vs_ideal: the whole model on one GPU (train_step over the same micro-batches)
  and 1F1B's per-GPU tokens/s over (1 - simulated bubble) x one GPU's (target >= 0.95);
- interleaved_vs_torch: our interleaved 1F1B over torch.distributed.pipelining's
  ScheduleInterleaved1F1B on the same stages and optimizer step (target >= 1.0);
- recv_at_use_vs_ahead: GPipe and 1F1B at m = 8 with receives posted one action ahead
  (parallel.pipeline_recv=ahead) against the default (posted where used, p2p.py): tokens/s and per
  stage F and B device ms.
`--schedules 1f1b zb-h1`: only those schedules on the same model (ZB-H1 against 1F1B in about two
minutes on 4 GPUs), without the comparisons that need the others.
--profile: one step of 1F1B and of ZB-H1 at m = 8 under torch.profiler, per rank: compute, exposed
communication, idle, host time per action kind, heaviest kernels (bench/pipeline_profile.py).
--parity-only: 1F1B, interleaved 1F1B and ZB-H1 through `teratrain train` at pp = N against 1 GPU on
the same global batch (8 layers of that width, bf16, 20 steps, each loss within 2e-2 relative:
bf16 accumulates in another order; the gloo tests show fp32 pipelining is exact). NVLink multicast
stays off.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import job_env, planner_card, sync, time_steps  # noqa: E402

from teratrain.models.layers import Positions  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MICROBATCHES, SMOKE_MICROBATCHES = [4, 8, 16], [4, 8]
PROFILE_M, SMOKE_PROFILE_M = 8, 4
WIDTH = ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048", "memory.precision=bf16"]
SMOKE = ["model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=512", "memory.precision=fp32",
         "train.device=cpu"]
MEMORY_FRACTION = 0.9
TIMED_STEPS = 3  # steps timed per action for the bubble; the median one is kept
GIB = 2**30


def model_sets(layers: int, micro_batch: int, smoke: bool) -> list[str]:
    return (SMOKE if smoke else WIDTH) + [f"model.n_layers={layers}", f"train.micro_batch={micro_batch}"]


def _layout(schedule: str, pp: int, m: int, micro_batch: int) -> list[str]:
    v = 2 if schedule == "interleaved-1f1b" else 1
    return [f"parallel.pp={pp}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
            f"train.global_batch={m * micro_batch}"]


def planned_gib(sets: list[str], gpu: str, pp: int = 1) -> float:
    """The planner's total (peak + allowance) for the fullest rank of the layout `sets` describes."""
    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import plan_memory

    cfg = load_config(None, sets)
    return plan_memory(shape_of(cfg), training_of(cfg), layout_of(cfg, pp), GPUS[gpu]).total / GIB


def size_to_gpu(pp: int, card_gib: float, gpu: str, ms: list[int]) -> dict:
    """The deepest model (layers a multiple of 2 pp) whose largest schedule at the largest m the
    planner puts within MEMORY_FRACTION of the card; micro-batch 2, else 1."""
    limit = MEMORY_FRACTION * card_gib
    for mb in (2, 1):
        best = None
        for layers in range(2 * pp, 64 * pp + 1, 2 * pp):
            sets = model_sets(layers, mb, smoke=False)
            worst = max(planned_gib(sets + _layout(s, pp, max(ms), mb), gpu, pp) for s in SCHEDULES)
            if worst > limit:
                break
            best = {"layers": layers, "micro_batch": mb, "planned_gib": round(worst, 2)}
        if best is not None:
            one = planned_gib(model_sets(best["layers"], mb, smoke=False) + [f"train.global_batch={max(ms) * mb}"], gpu)
            return {**best, "card_gib": round(card_gib, 2), "limit_gib": round(limit, 2), "gpu": gpu,
                    "one_gpu_planned_gib": round(one, 2), "one_gpu_fits": one <= limit}
    raise SystemExit(f"bench/pipeline.py: not even {2 * pp} layers fit {limit:.1f} GiB at micro-batch 1")


_RUNTIME = []  # one runtime (and its process groups) for every model this job builds
_BUILT: list = []  # a weak reference to every model built, to check that none outlives its measurement


def config(sets: list[str]):
    from teratrain.config import load_config

    return load_config(None, sets + ["train.eval_batches=0", "metrics.progress=false", "optim.warmup_steps=0"])


def runtime(sets: list[str]):
    """This job's runtime, made once (its process groups serve every model built after)."""
    from teratrain.mesh import init_runtime

    if not _RUNTIME:
        _RUNTIME.append(init_runtime(config(sets)))
    return _RUNTIME[0]


def build(sets: list[str]):
    from teratrain.models.transformer import Transformer
    from teratrain.parallel.parallelize import parallelize

    cfg, rt = config(sets), runtime(sets)
    cfg.parallel.dp = rt.dims.dp
    _collect()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    _BUILT.append(weakref.ref(model))
    return cfg, rt, model, parallelize(model, rt, cfg)


def micro_batches(cfg, m: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.model.vocab_size, (m * cfg.train.micro_batch, cfg.model.seq_len + 1), generator=g)
    t = t.to(device)
    return list(zip(t[:, :-1].split(cfg.train.micro_batch), t[:, 1:].split(cfg.train.micro_batch)))


def _max(x: float, device) -> float:
    """The largest x over every rank of the job."""
    t = torch.tensor([float(x)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def step_time(step, args, device, agree: bool = True) -> tuple[float, int]:
    """Median wall seconds of whole steps after `args.warmup`: as many as fit `args.seconds` (3 to
    `args.steps`; with `agree`, the same count on every rank, from the slowest rank's warm-up)."""
    t = 0.0
    for _ in range(max(1, args.warmup)):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        t = time.perf_counter() - t0
    n = max(3, min(args.steps, int(args.seconds / max(_max(t, device) if agree else t, 1e-6))))
    return statistics.median(time_steps(step, 0, n, device)), n


def _memory_start(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def _memory_end(device, retries0: int) -> tuple[float | None, int | None]:
    if device.type != "cuda":
        return None, None
    peak = _max(torch.cuda.max_memory_allocated(device) / GIB, device)
    return round(peak, 2), int(_max(torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries0, device))


def stage_ms(device_ivs, host_ivs, pp: int, num_stages: int) -> list[dict]:
    """Per stage: median device and host ms of each action kind."""
    out = []
    for s in range(num_stages):
        row = {}
        for kind in ("F", "B", "I", "W"):
            dev = [iv.end - iv.start for iv in device_ivs if iv.kind == kind and iv.chunk * pp + iv.rank == s]
            host = [iv.end - iv.start for iv in host_ivs if iv.kind == kind and iv.chunk * pp + iv.rank == s]
            if dev:
                row[kind] = round(statistics.median(dev) * 1e3, 3)
                row[f"{kind}_host"] = round(statistics.median(host) * 1e3, 3)
        out.append(row)
    return out


def ours(sets: list[str], schedule: str, ms: list[int], args) -> list[dict]:
    """Per m: tokens/s, peak memory, measured and simulated bubble, per-stage action times."""
    from teratrain.parallel.pipeline.runtime import PipelineExecutor
    from teratrain.parallel.pipeline.simulate import bubble_fraction, simulate
    from teratrain.parallel.pipeline.timing import measured_costs

    cfg, rt, model, engine = build(sets + _layout(schedule, args.pp, max(ms), args.mb))
    ex = PipelineExecutor(model, engine, rt, cfg)
    rows = []
    for m in ms:
        micro = micro_batches(cfg, m, rt.device)
        step = lambda: ex(micro, cfg.memory.precision, 1e-4)  # noqa: E731
        ex.time_every_call = False
        retries = _memory_start(rt.device)
        step_s, n = step_time(step, args, rt.device)
        peak, retried = _memory_end(rt.device, retries)
        ex.time_every_call = True
        sched = ex.schedule(m)
        timed = []  # TIMED_STEPS steps timed per action; the one of median measured bubble is kept
        for _ in range(TIMED_STEPS):
            step()
            timed.append((bubble_fraction(ex.intervals, sched.pp), ex.intervals, ex.host_intervals))
        timed.sort(key=lambda t: t[0])
        measured, intervals, host_intervals = timed[len(timed) // 2]
        rdv = cfg.parallel.pipeline_recv == "at_use"  # the simulator's model of when transfers start
        costs = measured_costs(intervals, sched.pp, sched.num_stages, rendezvous=rdv)
        simulated = simulate(sched, costs).bubble_fraction
        no_comm = simulate(sched, measured_costs(intervals, sched.pp, sched.num_stages, transfers=False))
        planned = planned_gib(sets + _layout(schedule, args.pp, m, args.mb), args.gpu, args.pp)
        rows.append({"schedule": schedule, "m": m, "steps": n,
                     "tokens_per_s": round(m * args.mb * cfg.model.seq_len / step_s, 1),
                     "step_ms": round(step_s * 1e3, 2), "peak_gib": peak, "alloc_retries": retried,
                     "planned_gib": round(planned, 2),
                     "bubble_measured": round(measured, 4), "bubble_simulated": round(simulated, 4),
                     "bubbles_timed": [round(t[0], 4) for t in timed],
                     "bubble_ratio": round(measured / simulated, 3) if simulated else None,
                     "bubble_simulated_no_comm": round(no_comm.bubble_fraction, 4),
                     "transfer_ms": [round(t * 1e3, 3) for t in costs.send_s],
                     "stage_ms": stage_ms(intervals, host_intervals, sched.pp, sched.num_stages)})
    return rows


def recv_modes(sets: list[str], rows: list[dict], m: int, args) -> list[dict]:
    """GPipe and 1F1B at m with receives posted one action ahead (parallel.pipeline_recv=ahead)
    against the default rows (posted where used): tokens/s and per-stage F and B device ms (p2p.py:
    a receive posted ahead spins beside the action it was meant to hide under)."""
    out = []
    for name in ("gpipe", "1f1b"):
        at_use = next(r for r in rows if r["schedule"] == name and r["m"] == m)
        ahead = ours(sets + ["parallel.pipeline_recv=ahead"], name, [m], args)[0]
        fb = lambda r: [{k: st[k] for k in ("F", "B") if k in st} for st in r["stage_ms"]]  # noqa: E731
        out.append({"schedule": name, "m": m, "at_use_tokens_per_s": at_use["tokens_per_s"],
                    "ahead_tokens_per_s": ahead["tokens_per_s"],
                    "at_use_over_ahead": round(at_use["tokens_per_s"] / ahead["tokens_per_s"], 3),
                    "stage_ms_at_use": fb(at_use), "stage_ms_ahead": fb(ahead)})
    return out


def one_gpu(sets: list[str], ms: list[int], args, fits: bool) -> list[dict]:
    """The whole model on one GPU (rank 0; the others wait): tokens/s of train_step over m micro-batches."""
    from teratrain.optim.engine import train_step
    from teratrain.measure import build_engine

    device = _RUNTIME[0].device
    rows = []
    if dist.get_rank() == 0 and fits:
        cfg = config(sets + [f"train.global_batch={max(ms) * args.mb}"])
        _collect()
        model, engine = build_engine(cfg, device)
        for m in ms:
            micro = micro_batches(cfg, m, device)
            step_s, n = step_time(lambda: train_step(model, engine, micro, cfg.memory.precision, 1e-4), args, device,
                                  agree=False)
            rows.append({"m": m, "steps": n, "tokens_per_s": round(m * args.mb * cfg.model.seq_len / step_s, 1)})
    dist.barrier()
    return rows


def torch_interleaved(sets: list[str], m: int, args) -> float:
    """tokens/s of torch.distributed.pipelining's ScheduleInterleaved1F1B on our interleaved stages."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from teratrain.memory.precision import autocast
    from teratrain.parallel.pipeline.stage import Chunk

    cfg, rt, model, engine = build(sets + _layout("interleaved-1f1b", args.pp, m, args.mb))
    layout = model.pipeline
    stages = [PipelineStage(TorchStage(Chunk(model, s, layout.num_stages, layout.bounds[s]), cfg), s, layout.num_stages,
                            rt.device, group=rt.group("pp")) for s in layout.stages]
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=lambda logits, y: model.criterion(logits, y))
    x, y = (torch.cat(t) for t in zip(*micro_batches(cfg, m, rt.device)))
    kw = {"return_outputs": False} if "return_outputs" in inspect.signature(sched.step).parameters else {}

    def step():
        with autocast(cfg.memory.precision, rt.device):
            if layout.rank == 0:
                sched.step(x, **kw)
            elif layout.rank == layout.pp - 1:
                sched.step(target=y, **kw)
            else:
                sched.step(**kw)
        engine.end_backward()
        engine.step(1e-4)

    step_s, _ = step_time(step, args, rt.device)
    return m * args.mb * cfg.model.seq_len / step_s


class TorchStage(nn.Module):
    """One of our chunks as the module torch's PipelineStage wants: tokens or hidden states in, hidden
    states or logits out (torch's schedule applies the loss itself)."""

    def __init__(self, chunk, cfg):
        super().__init__()
        m = chunk.model
        self.chunk, self.seq_len = chunk, cfg.model.seq_len
        self.parts = nn.ModuleList([chunk.blocks] + ([m.tok_embeddings] if chunk.is_first else [])
                                   + ([m.norm, m.output] if chunk.is_last else []))

    def forward(self, x):
        c, m = self.chunk, self.chunk.model
        h = c.embed(x) if c.is_first else x
        h = c.blocks(h, Positions(m.rope(0, self.seq_len)) if m.rope is not None else None)
        return m.head(h) if c.is_last else h


def profiled(sets: list[str], schedule: str, m: int, args) -> list[dict]:
    """One step of `schedule` at m under torch.profiler, every rank's account (rank order)."""
    from pipeline_profile import profile_step

    from teratrain.parallel.pipeline.runtime import PipelineExecutor

    cfg, rt, model, engine = build(sets + _layout(schedule, args.pp, m, args.mb))
    ex = PipelineExecutor(model, engine, rt, cfg)
    micro = micro_batches(cfg, m, rt.device)
    step = lambda: ex(micro, cfg.memory.precision, 1e-4)  # noqa: E731
    for _ in range(max(3, args.warmup)):  # past the executor's two timed calls
        step()
    mine = profile_step(step, rt.device)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _collect() -> None:
    """Free the models measured before (a model, its engine and executor hold reference cycles, so
    they outlive their function until a full collection; alive, the model states of the previous
    schedule would count in the next one's peak), and fail if one is still alive."""
    gc.collect()
    if any(ref() is not None for ref in _BUILT):
        raise RuntimeError("bench/pipeline.py: a model measured before is still alive; its memory would count "
                           "in the next measurement")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def derived(rows: list[dict], ones: list[dict], pp: int) -> dict:
    """ZB-H1 against 1F1B, and 1F1B against one GPU, at each m."""
    by = {(r["schedule"], r["m"]): r for r in rows}
    zb, ideal = [], []
    for (name, m), r in sorted(by.items()):
        if name != "zb-h1" or ("1f1b", m) not in by:
            continue
        base = by[("1f1b", m)]
        split = [{"stage": s, "I+W_over_B": round((z["I"] + z["W"]) / b["B"], 3),
                  "host_I+W_over_B": round((z["I_host"] + z["W_host"]) / b["B_host"], 3)}
                 for s, (z, b) in enumerate(zip(r["stage_ms"], base["stage_ms"])) if "I" in z]  # stage 0 runs B
        zb.append({"m": m, "tokens_ratio": round(r["tokens_per_s"] / base["tokens_per_s"], 3),
                   "peak_ratio": round(r["peak_gib"] / base["peak_gib"], 3) if base["peak_gib"] else None,
                   "split_backward": split})
    for one in ones:
        r = by.get(("1f1b", one["m"]))
        if r is not None:
            best = (1 - r["bubble_simulated"]) * one["tokens_per_s"]
            ideal.append({"m": one["m"], "per_gpu_tokens_per_s": round(r["tokens_per_s"] / pp, 1),
                          "ideal_tokens_per_s": round(best, 1), "ratio": round(r["tokens_per_s"] / pp / best, 3)})
    return {"zb_vs_1f1b": zb, "one_f_one_b_vs_ideal": ideal}


def worker(args) -> None:
    from teratrain.planner.hardware import GPUS

    t0 = time.perf_counter()
    args.pp = int(os.environ["WORLD_SIZE"])
    ms = SMOKE_MICROBATCHES if args.smoke else MICROBATCHES
    rt = runtime(model_sets(2 * args.pp, 1, args.smoke) + [f"parallel.pp={args.pp}"])
    sizing = {gpu: size_to_gpu(args.pp, GPUS[gpu].memory_gib, gpu, MICROBATCHES) for gpu in ("h100", "h200")} \
        if args.smoke else _size_here(rt.device, args.pp, ms)  # smoke: what the GPUs would run
    layers, args.mb = (4, 2) if args.smoke else (sizing["layers"], sizing["micro_batch"])
    args.gpu = "h100" if args.smoke else sizing["gpu"]
    sets = model_sets(layers, args.mb, args.smoke)
    rows = [r for s in args.schedules for r in ours(sets, s, ms, args)]
    ones, recv, versus = [], [], []
    if args.schedules == SCHEDULES:  # the comparisons with other peers: only in the whole run
        ones = one_gpu(sets, ms, args, fits=args.smoke or sizing["one_gpu_fits"])
        recv = recv_modes(sets, rows, SMOKE_PROFILE_M if args.smoke else PROFILE_M, args)
        for m in ms:
            theirs = torch_interleaved(sets, m, args)
            mine = next(r["tokens_per_s"] for r in rows if r["schedule"] == "interleaved-1f1b" and r["m"] == m)
            versus.append({"m": m, "ours_tokens_per_s": mine, "torch_tokens_per_s": round(theirs, 1),
                           "ratio": round(mine / theirs, 3)})
    prof = {s: profiled(sets, s, SMOKE_PROFILE_M if args.smoke else PROFILE_M, args) for s in ("1f1b", "zb-h1")} \
        if args.profile else None
    if int(os.environ["RANK"]) == 0:
        result = {"bench": "pipeline", "pp": args.pp, "model": sets, "sizing": sizing, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "schedules": rows, **derived(rows, ones, args.pp), "one_gpu": ones,
                  "interleaved_vs_torch": versus, "recv_at_use_vs_ahead": recv,
                  "wall_s": round(time.perf_counter() - t0, 1)}
        if prof is not None:
            result["profile"] = {"m": SMOKE_PROFILE_M if args.smoke else PROFILE_M, **prof}
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
    dist.barrier()
    from teratrain.mesh import shutdown

    shutdown()


def _size_here(device, pp: int, ms: list[int]) -> dict:
    """size_to_gpu for this job's card (every rank takes rank 0's answer)."""
    gpu = planner_card(device)
    card = torch.cuda.mem_get_info(device)[1] / GIB
    sizing = [size_to_gpu(pp, card, gpu, ms) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sizing, src=0)
    return sizing[0]


def parity(n: int, smoke: bool, steps: int) -> list[dict]:
    """`teratrain train` at pp=n under three schedules against one process, step by step."""
    sets = (["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "train.device=cpu"]
            if smoke else ["model.preset=llama-1b", "model.vocab_size=32000", "model.n_layers=8",
                           "model.seq_len=2048", "memory.precision=bf16"])
    sets += [f"train.global_batch={4 * n}", "train.micro_batch=1", "train.eval_batches=0", "metrics.progress=false",
             "optim.warmup_steps=2"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        one = _train(1, sets, steps, Path(tmp) / "one")
        for schedule in ("1f1b", "interleaved-1f1b", "zb-h1"):
            v = 2 if schedule == "interleaved-1f1b" else 1
            many = _train(n, sets + [f"parallel.pp={n}", f"parallel.schedule={schedule}",
                                     f"parallel.virtual_stages={v}"], steps, Path(tmp) / schedule)
            err = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(many, one))
            out.append({"schedule": schedule, "pp": n, "steps": len(many), "max_rel_loss_diff": err,
                        "within_2e-2": err <= 2e-2, "final_loss": [many[-1]["loss"], one[-1]["loss"]]})
    return out


def _train(nproc: int, sets: list[str], steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "teratrain", "train", "--out", str(out), "--steps", str(steps), *[a for x in sets for a in ("--set", x)]]
    env = job_env()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one profiled step of 1F1B and ZB-H1 (torch.profiler)")
    ap.add_argument("--seconds", type=float, default=4.0, help="timed seconds per (schedule, m), at least 3 steps")
    ap.add_argument("--steps", type=int, default=10, help="most timed steps per (schedule, m)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--parity-only", action="store_true", help="only the parity runs through `teratrain train`")
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=SCHEDULES,
                    help="only these (the same model); one_gpu, interleaved_vs_torch and recv_at_use_vs_ahead "
                         "need all four")
    args = ap.parse_args()
    args.schedules = [s for s in SCHEDULES if s in args.schedules]
    if args.smoke:
        args.steps, args.warmup, args.seconds = 3, 1, 0.0
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return
    n = 2 if args.smoke else torch.cuda.device_count()
    if n < 2:
        sys.exit("bench/pipeline.py needs at least 2 GPUs (or --smoke for CPU processes)")
    if args.parity_only:
        text = json.dumps({"bench": "pipeline", "pp": n, "parity": parity(n, args.smoke, 4 if args.smoke else 20)},
                          indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           *sys.argv[1:]]
    env = job_env()
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
