"""Mixture of experts at ep=1 and ep>1 against the dense model with the same active FLOPs, in one
torchrun job.

    torchrun --nproc-per-node 2 bench/moe.py           # 2 GPUs: dense, MoE ep=1, ep=2, ep=2 dropless, the ep=2
                                                       # runs also chunked (~4 min; 3 without the chunked runs)
    torchrun --nproc-per-node 4 bench/moe.py --ep 1,2,4   # 4 GPUs: ... ep=2, ep=4, ep=4 dropless (~3 min)
    torchrun --nproc-per-node 2 bench/moe.py --profile # + a torch.profiler account of 2 steps of each model
    python bench/moe.py --smoke                        # 2 CPU processes over gloo, tiny shapes: checks the script
    torchrun --nproc-per-node 1 bench/moe.py --shape qwen3-30b-a3b --ep 1 --compile --no-one-gpu --parity-steps 0
                                                       # 1 GPU: Qwen3-30B-A3B's MoE layers vs dense, eager and compiled
    torchrun --nproc-per-node 2 bench/moe.py --compile --compile-only --a2a-chunks 1 --only dense,moe_ep1,moe_ep2
                                                       # the same models compiled (train.compile): ~3 min

Model (GPU): Llama-style, d_model 2048, 8 blocks, 16 heads (8 key/value), 32k vocab, 2048 tokens per
sequence, bf16 autocast. MoE: every block's MLP is 8 SwiGLU experts of width 2816, top-2
(`softmax-topk`, capacity factor 1.25, `--capacity 0`: none); dense: one SwiGLU MLP of width 5632, so a token multiplies
the same weights (plus the MoE router's 8 x 2048). `--shape qwen3-30b-a3b`: Qwen3-30B-A3B's layers cut
to 8 (32 heads, 4 key/value heads; the head width stays d_model / heads = 64, and the vocabulary
32k): 128 fine-grained experts of width 768 (model.moe.expert_d_ff), top-8 renormalized (norm_topk), no
capacity limit; dense: one MLP of width 8 x 768 = 6144, the same active FLOPs; at most 2 sequences
per micro-batch (AdamW's state of 4.8 B expert parameters takes ~77 GB). Every model runs data parallel over every rank,
2 micro-batches per rank, AdamW, on random tokens; the micro-batch is sized from the GPU's memory
(4 sequences from 60 GiB free, as on an H100 or H200; fewer below). The MoE runs at each `--ep`
(default 1 and the process count): at ep=1 each rank holds every expert (no all-to-all); at ep>1
the experts are spread and exchanged with the padded all-to-all of parallel/expert.py (a capacity:
no read-back), and once more without a capacity (`_dropless`: exact rows after one count read-back
per layer). Every MoE run at ep>1 runs again for each `--a2a-chunks` setting (default 2 and 4) with
its exchange cut into that many pipelined pieces (`_chunks4`: parallel.ep_overlap_chunks=4, each
piece's all-to-all under another piece's experts, forward and backward).

After the timed runs (a run cut short keeps them: the JSON is written after each), a parity check:
the MoE at the largest ep (chunked, where it is) against one process on rank 0's GPU training the
same global batches (every step's loss; the GPU run is bf16, so expect ~1e-2 relative, as
bench/multi_gpu.py allows; the fp32 smoke run is exact to ~1e-6).

Reported (one JSON object, rank 0): `parity`; for each model tokens/s over all ranks, MFU of the active
FLOPs (PaLM 6N + 12LHQT with N the active matmul weights, as the trainer counts it), step time, peak
memory; for each MoE the share of routed choices dropped for capacity (`dropped`), at ep>1 with a
capacity the share of the rows its fixed-size exchange sends that carry no token (`exchange_padding`),
and, at ep>1, the all-to-all's
exposed share of the step (`all_to_all_share`: the exchanges of counts and rows, forward and backward,
whole or by chunk, each launched asynchronously and timed by CUDA events on the compute stream just
before and after its wait, in separate instrumented steps: the time the compute stream stands still
for them, not the NCCL kernels' durations, which overlap compute once chunked) and
`moe_layer_host_syncs`, "none" when one MoE layer's forward and backward never wait for the device
(torch.cuda.set_sync_debug_mode("error"); the dropless exchange reads its counts back by design);
`moe_vs_dense`, each MoE's tokens/s over the dense model's in the same mode; `a2a_overlap`, per chunked
run, the exposed share whole (`share_chunks1`) and chunked (`share_chunked`)
and `tokens_per_s_vs_chunks1`, the chunked run's tokens/s over the whole one's; `experts_kernel`, grouped
GEMM or loop (models/grouped.py). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device
machines require.

`--compile`: every model once more with train.compile (`NAME_compiled`, or `NAME_graphed` where `--set
train.compile_mode=reduce-overhead` puts the step in CUDA graphs; `--compile-only` drops the eager
runs), and the parity check compiled. Each compiled run reports `first_step_s` (the compile,
mostly) and `graph_breaks` (count, compiled graphs, the top reasons, as bench/tensor_parallel.py
does; 0 breaks is the point: the eager MoE step is host-bound, and a compiled graph launches its
kernels without Python in between) and `vs_eager`
where its eager run is in the job; `moe_vs_dense` then compares compiled with compiled. The
all-to-all's waits are inside the graph, so compiled runs at ep > 1 report instead
`all_to_all_kernel_share`: the NCCL all-to-all kernels' device time over the wall time of 2
profiled steps (the exposed share with the exchange whole; an upper bound when chunked), and
`all_to_all_exposed_share`, the part of it under no compute kernel (bench/trace_summary.py); with
`--reorder` each MoE at ep > 1 runs once more with inductor's collective reordering
(`NAME_reorder_compiled`, train.compile_overlap), where the two shares tell what it hid. The layer's
host syncs are not checked compiled. Compiled, the dropless exchange at ep > 1 is the padded one
with N slots per expert (parallel/expert.py), so `_dropless` compiled moves n/k times the rows. --smoke traces the same
graphs but runs them with the aot_eager backend (inductor would compile C++ for minutes on 2 cores).

One GPU (on by default; `--no-one-gpu` skips it): after the timed runs, the dense model and the MoE at
ep=1 once more on rank 0's GPU alone, with the same per-GPU batch, in every mode of the job
(`one_gpu_dense[_compiled|_graphed]`, `one_gpu_moe_ep1[...]`; the other ranks wait).
`per_gpu_efficiency_same_mode`, the headline, then gives each run's tokens/s per GPU over one GPU's in
the same mode: the dense model over its own, every MoE over the MoE at ep=1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from pathlib import Path

import torch
import torch.distributed as dist
# common puts the checkout on sys.path
from common import (NO_MULTICAST, fresh_compile, fresh_memory, graph_breaks, in_job, job_env, smoke_compile, summarize,
                    time_steps)

from teratrain.compat import grouped_mm_without_sync  # noqa: E402
from teratrain.config import load_config  # noqa: E402
from teratrain.memory.precision import autocast  # noqa: E402
from teratrain.mesh import Runtime, init_runtime, pick_device  # noqa: E402
from teratrain.models.moe import moe_layers  # noqa: E402
from teratrain.models.transformer import Transformer, count_params, flops_per_token  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.parallel import comm  # noqa: E402
from teratrain.parallel.comm import AVG, MAX, all_reduce  # noqa: E402
from teratrain.parallel.parallelize import compile_scope, parallelize  # noqa: E402
from teratrain.planner.refit import how_it_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPU = ["model.n_layers=8", "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=8", "model.vocab_size=32000",
       "model.seq_len=2048", "memory.precision=bf16"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
         "model.seq_len=32", "memory.precision=fp32", "train.device=cpu"]
EXPERT_FF = {"gpu": 2816, "smoke": 64}
MICRO_PER_RANK = 2  # micro-batches per rank and step
COMPILED = ["train.compile=true"]
MODE_TAGS = ("_compiled", "_graphed")  # a run's name ends with its mode's tag; eager runs have none
MODE_NAMES = {"": "eager", "_compiled": "compiled", "_graphed": "CUDA graphs"}


# qwen3-30b-a3b: (attention heads, expert width, experts, top-k) on the GPU and in the smoke run
QWEN3 = {"gpu": (["model.n_heads=32", "model.n_kv_heads=4"], 768, 128, 8), "smoke": ([], 16, 16, 4)}


def models(smoke: bool, eps: list[int], chunks: list[int], shape: str = "8x2816-top2",
           capacity: float = 1.25) -> dict[str, list[str]]:
    """Each model's settings: the dense peer, the MoE at every ep, the largest ep once more dropless
    (the 8-expert shape), and every MoE at ep > 1 once more per `chunks` setting
    (parallel.ep_overlap_chunks)."""
    if shape == "qwen3-30b-a3b":
        heads, ff, n, k = QWEN3["smoke" if smoke else "gpu"]
        moe = heads + [f"model.d_ff={k * ff}", f"model.moe.num_experts={n}", f"model.moe.top_k={k}",
                       f"model.moe.expert_d_ff={ff}", "model.moe.router=softmax-topk", "model.moe.norm_topk=true",
                       "model.moe.capacity_factor=0"]
        out = {"dense": heads + [f"model.d_ff={k * ff}"]}
        out.update({f"moe_ep{ep}": moe + [f"parallel.ep={ep}"] for ep in eps})
    else:
        ff = EXPERT_FF["smoke" if smoke else "gpu"]
        moe = [f"model.d_ff={ff}", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.router=softmax-topk"]
        out = {"dense": [f"model.d_ff={2 * ff}"]}
        out.update({f"moe_ep{ep}": moe + [f"model.moe.capacity_factor={capacity}", f"parallel.ep={ep}"] for ep in eps})
        if max(eps) > 1 and capacity > 0:
            out[f"moe_ep{max(eps)}_dropless"] = moe + ["model.moe.capacity_factor=0", f"parallel.ep={max(eps)}"]
    for name in [n for n in out if n.startswith("moe_") and n != "moe_ep1"]:
        out.update({f"{name}_chunks{c}": out[name] + [f"parallel.ep_overlap_chunks={c}"] for c in chunks if c > 1})
    return out


def micro_batch(smoke: bool) -> int:
    """Sequences per micro-batch: 4 of 2048 tokens from 60 GiB free (the MoE at ep=1, the largest,
    peaks at 33 GiB with 4), else fewer; 2 of 32 in the smoke run."""
    if smoke:
        return 2
    free = torch.cuda.mem_get_info()[0] / 2**30
    return 4 if free >= 60 else 2 if free >= 35 else 1


def build(sets: list[str], single: bool = False, reference: bool = False):
    """(cfg, runtime, model, engine) through parallelize(); `single`: one process on this rank's
    device, whatever the job's size (`--one-gpu`); `reference`: that, eager (the parity check's)."""
    single = single or reference
    single_sets = ["parallel.ep=1"] + (["train.compile=false", "train.compile_mode=default"] if reference else [])
    cfg = load_config(None, sets + ["optim.warmup_steps=0", "metrics.progress=false"] + (single_sets if single else []))
    rt = Runtime.single(pick_device(cfg.train.device, int(os.environ["LOCAL_RANK"]))) if single else init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    torch.manual_seed(cfg.train.seed + rt.dp_rank)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return cfg, rt, model, parallelize(model, rt, cfg)


def parity(sets: list[str], steps: int) -> dict | None:
    """Every step's loss of the job (experts over ep ranks) against one process on rank 0 training
    the same global batches (random tokens), as micro-batches in the same order. Rank 0 returns it."""
    fresh_compile()
    cfg, rt, model, engine = build(sets)
    tc, m = cfg.train, cfg.model
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, m.vocab_size, (tc.global_batch, m.seq_len + 1), generator=g) for _ in range(steps)]
    per = tc.global_batch // rt.dims.dp
    got = _losses(cfg, rt, model, engine, [b[rt.dp_rank * per:(rt.dp_rank + 1) * per] for b in batches])
    del model, engine
    fresh_memory(rt.device)
    out = None
    if rt.rank == 0:
        ref = _losses(*build(sets, reference=True), batches)
        err = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        out = {"steps": steps, "max_rel_loss_diff": err, "losses": got, "one_process": ref}
    fresh_memory(rt.device)
    rt.barrier()
    return out


def _losses(cfg, rt, model, engine, batches: list[torch.Tensor]) -> list[float]:
    """Train on this rank's rows of each step's batch; every step's loss averaged over dp."""
    mb, out = cfg.train.micro_batch, []
    for rows in batches:
        rows = rows.to(rt.device)
        micro = [(rows[i:i + mb, :-1], rows[i:i + mb, 1:]) for i in range(0, rows.shape[0], mb)]
        _, loss = train_step(model, engine, micro, cfg.memory.precision, cfg.optim.lr)
        loss = loss.detach().float().clone()
        all_reduce(loss, rt.dp_group, op=AVG)
        out.append(float(loss))
    return out


def measure(sets: list[str], args, single: bool = False, name: str = "") -> dict:
    """Build one model through parallelize() and time its optimizer steps on random tokens; compiled
    (train.compile): also its graph breaks, every one a return to Python on each step. `single`: one
    process on this rank's GPU (`--one-gpu`); `name`: the run's, naming its `--trace` file."""
    compiled = "train.compile=true" in sets
    if compiled:
        fresh_compile()
    cfg, rt, model, engine = build(sets, single=single)
    tc, m = cfg.train, cfg.model
    num_micro = tc.global_batch // (tc.micro_batch * rt.dims.dp)
    data = torch.randint(0, m.vocab_size, (num_micro, tc.micro_batch, m.seq_len + 1), device=rt.device)
    micro = [(b[:, :-1], b[:, 1:]) for b in data]

    def step():
        train_step(model, engine, micro, cfg.memory.precision, cfg.optim.lr)

    first_s = time_steps(step, 0, 1, rt.device)[0] if compiled else None  # compiled: its first step compiles
    times = time_steps(step, args.warmup, args.steps, rt.device)
    tokens = tc.global_batch * m.seq_len
    out = summarize(times, tokens, flops_per_token(m), rt.device, cfg.memory.precision)
    out["step_ms_each"] = [round(t * 1e3, 1) for t in times]  # how many steps a mode takes to reach speed
    out["mfu"] = round(out["mfu"] / rt.dims.workers, 4) if out["mfu"] else None  # peak of every rank
    out["step_ms_max_rank"] = _max_over_ranks(out["step_ms"], rt)
    if moe_layers(model):
        for _, layer in moe_layers(model):
            layer.pop_stats()
        if rt.dims.ep > 1 and not compiled:  # compiled, the exchanges' waits are inside the graph: not timed
            out["all_to_all_share"] = _all_to_all_share(step, args.instrumented_steps, rt.device)
        else:
            time_steps(step, 0, 1, rt.device)  # one step's statistics
        if rt.dims.ep > 1 and compiled and rt.device.type == "cuda":
            out.update(_all_to_all_kernel_share(step, rt.device))
        stats = [layer.pop_stats() for _, layer in moe_layers(model)]
        dropped = sum(float(s["dropped"]) for s in stats) / max(1.0, sum(float(s["attempted"]) for s in stats))
        out["dropped"] = round(dropped, 4)
        if rt.dims.ep > 1 and cfg.model.moe.capacity_factor > 0:
            out["exchange_padding"] = _exchange_padding(model, stats, micro[0][0].numel(), cfg.model.moe.top_k)
        if rt.device.type == "cuda" and not compiled:  # the layer alone runs eager: said for the eager rows
            out["moe_layer_host_syncs"] = _host_syncs(moe_layers(model)[0][1], micro[0][0].numel(), cfg, rt.device)
    if args.profile:
        trace = f"{args.trace}_{name}.json.gz" if args.trace and int(os.environ["RANK"]) == 0 else None
        out["profile"] = _profile(step, rt.device, trace)
    out["active_params"], out["params"] = count_params(m)["active"], count_params(m)["total"]
    if compiled:
        out["first_step_s"] = round(first_s, 1)  # the compile, mostly
        out["graph_breaks"] = graph_breaks()
        out["compile_scope"] = compile_scope(cfg, rt.dims.dp)  # model: one graph; block: each block apart
    del model, engine
    fresh_memory(rt.device)
    return out


def _all_to_all_share(step, steps: int, device: torch.device) -> float:
    """The exchanges' exposed share of `steps` instrumented steps: the time the compute stream waits
    for them (`_timed_all_to_all`), summed after the steps, over their wall time."""
    spans: list = []
    t0 = time.perf_counter()
    with _timed_all_to_all(spans, device):
        for _ in range(steps):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_s = time.perf_counter() - t0
    if device.type == "cuda":
        exchanged = sum(a.elapsed_time(b) for a, b in spans) / 1e3
    else:
        exchanged = sum(b - a for a, b in spans)
    return round(exchanged / step_s, 4)


def _exchange_padding(model, stats: list[dict], tokens: int, k: int) -> float:
    """The share of the rows a capacity-limited exchange sends that carry no token: it sends every
    expert's `max_rows` slots (fixed sizes, no count read back to the host), used or not; the used ones
    are the routed choices not dropped. Over the same step's statistics as `dropped`."""
    layers = [layer for _, layer in moe_layers(model)]
    sent = sum(float(st["forwards"]) * layer.num_experts * layer.router.max_rows(tokens, k)
               for st, layer in zip(stats, layers))
    used = sum(float(st["attempted"]) - float(st["dropped"]) for st in stats)
    return round(1 - used / sent, 4) if sent else 0.0


def _all_to_all_kernel_share(step, device: torch.device) -> dict:
    """Compiled runs at ep > 1, whose exchanges are waited for inside the graph: over the wall time of
    2 profiled steps, the time NCCL's all-to-all kernels run (NCCL runs all_to_all as grouped
    send/recv; with the exchange whole the experts wait for it, so this is its exposed share, an upper
    bound where chunks overlap it) and the part of it under no compute kernel."""
    from pipeline_profile import length, minus, union
    from trace_summary import traced_kernels

    _, kernels, wall = traced_kernels(step, device)
    exchange = ("sendrecv", "alltoall")
    a2a = union([(a, b) for n, a, b in kernels if "nccl" in n.lower() and any(k in n.lower() for k in exchange)])
    compute = union([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    return {"all_to_all_kernel_share": round(length(a2a) / 1e6 / wall, 4),
            "all_to_all_exposed_share": round(minus(a2a, compute) / 1e6 / wall, 4)}


class _TimedWait:
    """A collective's handle whose wait is timed: CUDA events on the compute stream just before and
    after `wait()` (which makes that stream wait for NCCL's), so the span is how long the compute
    stream stood still for the exchange: all of it for an exchange waited for at once, the part not
    hidden under the compute queued in between for a launched-then-landed chunk. Host time on a CPU."""

    def __init__(self, work, spans: list, device: torch.device):
        self.work, self.spans, self.cuda = work, spans, device.type == "cuda"

    def wait(self) -> bool:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.work.wait()
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            self.work.wait()
            self.spans.append((t0, time.perf_counter()))
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextlib.contextmanager
def _timed_all_to_all(spans: list, device: torch.device):
    """Time the wait of every all-to-all (the counts exchange and every row exchange, forward and
    backward, whole or by chunk): each is launched asynchronously and its handle's wait timed."""
    original = comm.all_to_all

    def timed(out, inp, out_splits, in_splits, group, async_op=False):
        work = _TimedWait(original(out, inp, out_splits, in_splits, group, async_op=True), spans, device)
        if async_op:
            return work
        work.wait()
        return comm.Done()

    comm.all_to_all = timed
    try:
        yield
    finally:
        comm.all_to_all = original


def _host_syncs(layer, tokens: int, cfg, device: torch.device) -> str:
    """'none' when one MoE layer's forward and backward (and its exchange at ep > 1: every rank runs
    this) wait for the device nowhere (torch.cuda.set_sync_debug_mode("error")), else the error."""
    x = torch.randn(tokens, cfg.model.d_model, device=device, requires_grad=True)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with autocast(cfg.memory.precision, device):
            y = layer(x.unsqueeze(0))
        torch.autograd.grad(y.float().sum(), [x, *layer.parameters()])  # no accumulation: the engine's hooks stay out
        return "none"
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        layer.pop_stats()


def _profile(step, device: torch.device, trace: str | None = None) -> dict:
    """torch.profiler over 2 steps (bench/trace_summary.py): per step, the GPU's busy and idle time, its
    NCCL kernels' time and the part of it no compute kernel runs under, copies, and the top ops;
    `trace`: the Chrome trace written there too."""
    from trace_summary import profile_steps

    return profile_steps(step, device, steps=2, top=12, trace=trace)


def _max_over_ranks(value: float, rt) -> float:
    t = torch.tensor([value], device=rt.device, dtype=torch.float64)
    all_reduce(t, rt.group("world"), op=MAX)
    return float(t)


def worker(args) -> None:
    for key, value in NO_MULTICAST.items():  # before NCCL starts
        os.environ.setdefault(key, value)
    world = int(os.environ["WORLD_SIZE"])
    eps = sorted(set(args.ep or [1, world]))
    if not args.smoke:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before reading its free memory
    mb = micro_batch(args.smoke) if args.shape != "qwen3-30b-a3b" else min(micro_batch(args.smoke), 2)
    base = (SMOKE if args.smoke else GPU) + [f"train.micro_batch={mb}",
                                             f"train.global_batch={args.global_batch or MICRO_PER_RANK * world * mb}"]
    base += [s for s in args.set if s not in compiled_sets(args)]  # every model, dense and MoE alike
    ran = load_config(None, base).train  # the batch the runs take (--set may change the micro-batch)
    batch = (ran.micro_batch, ran.global_batch)
    if args.compile and args.smoke:
        smoke_compile()
    runs = models(args.smoke, eps, args.a2a_chunks, args.shape, args.capacity)
    checked = f"moe_ep{max(eps)}_chunks{max(args.a2a_chunks)}"  # the pipelined exchange where there is one
    checked = base + runs.get(checked, runs[f"moe_ep{max(eps)}"]) + (compiled_sets(args) if args.compile else [])
    runs = in_modes({name: sets for name, sets in runs.items()
                     if not args.parity_only and (not args.only or name in args.only)}, args)
    results = {}
    for name, sets in runs.items():  # the speeds first: a run cut short by a time limit keeps those it measured
        results[name] = measure(base + sets, args, name=name)
        if int(os.environ["RANK"]) == 0 and args.out:
            Path(args.out).write_text(_report(args, world, eps, batch, None, results, partial=True))
    if args.one_gpu:
        results.update(one_gpu(base, mb, args))
    check = parity(checked, args.parity_steps) if args.parity_steps > 0 else None
    if int(os.environ["RANK"]) == 0:
        text = _report(args, world, eps, batch, check, results)
        print(text)
        if args.out:
            Path(args.out).write_text(text)


def one_gpu(base: list[str], mb: int, args) -> dict:
    """`--one-gpu`: the dense model and the MoE at ep=1, in this job's modes (eager, compiled), on rank 0's
    GPU alone with the same per-GPU batch while the other ranks wait, named one_gpu_NAME[_compiled|_graphed]:
    the baseline of `per_gpu_efficiency_same_mode`, from the same job."""
    out = {}
    if int(os.environ["RANK"]) == 0:
        per_gpu = [f"train.global_batch={MICRO_PER_RANK * mb}"]  # after base's: the later setting wins
        runs = models(args.smoke, [1], [1], args.shape, args.capacity)  # dense and moe_ep1
        for name, sets in in_modes(runs, args).items():
            out[f"one_gpu_{name}"] = measure(base + sets + per_gpu, args, single=True)
    dist.barrier()
    return out


def in_modes(runs: dict[str, list[str]], args) -> dict[str, list[str]]:
    """The runs in the job's modes: as given, and with --compile each once more compiled (NAME_compiled, or
    NAME_graphed under CUDA graphs; only those with --compile-only)."""
    if not args.compile:
        return runs
    tag = compiled_tag(args)
    compiled = {f"{name}{tag}": sets + compiled_sets(args) for name, sets in runs.items()}
    if args.reorder:  # each exchanging MoE once more with inductor's collective reordering
        compiled.update({f"{name}_reorder{tag}": sets + compiled_sets(args) + ["train.compile_overlap=true"]
                         for name, sets in runs.items() if name.startswith("moe_") and "parallel.ep=1" not in sets})
    return compiled if args.compile_only else {**runs, **compiled}


def compiled_sets(args) -> list[str]:
    """The settings of this job's compiled runs: train.compile, and any `--set train.compile_mode=...` (a mode
    of train.compile, refused on the eager runs)."""
    return COMPILED + [s for s in args.set if s.startswith("train.compile_mode=")]


def compiled_tag(args) -> str:
    """The suffix of this job's compiled runs: `_graphed` where --set puts the step in CUDA graphs."""
    return "_graphed" if "train.compile_mode=reduce-overhead" in args.set else "_compiled"


def mode_tag(name: str) -> str:
    """A run's mode suffix: "" (eager), "_compiled" or "_graphed"."""
    return next((tag for tag in MODE_TAGS if name.endswith(tag)), "")


def per_gpu_efficiency_same_mode(results: dict, world: int) -> dict:
    """Each model's tokens/s per GPU over one GPU's in the same job and the same mode: the dense model
    over its own, every MoE over one GPU's ep=1 (weak scaling of expert parallelism)."""
    out = {}
    for name, r in results.items():
        if name.startswith("one_gpu_"):
            continue
        tag = mode_tag(name)
        one = results.get("one_gpu_" + ("dense" if name.startswith("dense") else "moe_ep1") + tag)
        if one is not None:
            out[name] = round(r["tokens_per_s"] / world / one["tokens_per_s"], 4)
    return out


def _report(args, world: int, eps: list[int], batch: tuple[int, int], check: dict | None, results: dict,
            partial: bool = False) -> str:
    """The JSON object of the runs measured so far (`partial`: more were due); `batch`: (micro-batch,
    global batch) in sequences."""
    cuda = torch.cuda.is_available() and not args.smoke
    hopper = cuda and grouped_mm_without_sync(torch.device("cuda"), torch.bfloat16)
    return json.dumps({"world": world, "eps": eps, "shape": args.shape, "set": args.set, "smoke": args.smoke, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if cuda else "cpu", "micro_batch": batch[0],
                       "global_batch": batch[1],
                       "gpu_gib": round(torch.cuda.mem_get_info()[1] / 2**30, 1) if cuda else None,
                       **how_it_runs(),  # the code's settings planner/refit.py as_ran reads
                       "experts_kernel": "grouped_mm" if hopper else "loop",
                       "experts_kernel_compiled": "grouped_mm" if cuda else "grouped_mm_loop",
                       **({"partial": True} if partial else {}),
                       "parity": check, **results, "moe_vs_dense": _vs_dense(results),
                       "modes": sorted({MODE_NAMES[mode_tag(name)] for name in results}),
                       "per_gpu_efficiency_same_mode": per_gpu_efficiency_same_mode(results, world),
                       "a2a_overlap": _overlap(results)})


def _vs_dense(results: dict) -> dict:
    """Each MoE's tokens/s over the dense model's, compiled against compiled and eager against eager;
    and `vs_eager` on every compiled run whose eager run is in the same job."""
    ratios = {}
    for name, r in results.items():
        tag = mode_tag(name)
        eager = results.get(name.removesuffix(tag)) if tag else None
        if eager is not None:
            r["vs_eager"] = round(r["tokens_per_s"] / eager["tokens_per_s"], 4)
        if name.startswith(("moe_", "one_gpu_moe_")):
            dense = results.get(("one_gpu_dense" if name.startswith("one_gpu_") else "dense") + tag)
            if dense is not None:
                ratios[name] = round(r["tokens_per_s"] / dense["tokens_per_s"], 4)
    return ratios


def _overlap(results: dict) -> dict:
    """Per MoE run at ep > 1 and chunk setting: the exposed all-to-all share whole (chunks=1) and
    chunked, and the chunked run's tokens/s over the whole one's."""
    out = {}
    for name, r in results.items():
        head, chunked, tail = name.partition("_chunks")
        whole = results.get(head + tail.lstrip("0123456789"))  # the same run with the exchange whole
        if not chunked or whole is None:
            continue
        speed = round(r["tokens_per_s"] / whole["tokens_per_s"], 4)
        out[name.removeprefix("moe_")] = {"share_chunks1": whole.get("all_to_all_share"),
                                          "share_chunked": r.get("all_to_all_share"), "tokens_per_s_vs_chunks1": speed}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="expert-parallel degrees to run, comma-separated, each dividing the process count "
                        "(default: 1 and the process count)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--a2a-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                   help="parallel.ep_overlap_chunks settings to run each MoE at ep > 1 with, besides 1 "
                        "(comma-separated; default 2,4)")
    p.add_argument("--instrumented-steps", type=int, default=3, help="steps timing the all-to-alls (ep > 1)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks "
                   "(default: 2 micro-batches per rank)")
    p.add_argument("--parity-only", action="store_true", help="only the parity check, no timed runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for every model, dense and MoE (repeatable), e.g. memory.master_weights=true "
                        "(bf16 weights, fp32 masters) or parallel.reduce_dtype=bf16")
    p.add_argument("--parity-steps", type=int, default=6, help="steps of the loss check against one process (0: none)")
    p.add_argument("--profile", action="store_true", help="add a torch.profiler account of 2 steps of each model")
    p.add_argument("--trace", metavar="PREFIX", help="with --profile: rank 0 also writes each model's Chrome trace "
                   "to PREFIX_NAME.json.gz (Perfetto opens it)")
    p.add_argument("--compile", action="store_true",
                   help="run every model once more with train.compile (NAME_compiled: graph breaks, vs_eager, "
                        "moe_vs_dense against the compiled dense model); the parity check runs compiled")
    p.add_argument("--compile-only", action="store_true", help="with --compile: only the compiled runs")
    p.add_argument("--reorder", action="store_true", help="with --compile: every MoE at ep > 1 once more with "
                   "train.compile_overlap (NAME_reorder_compiled: inductor moves each all-to-all's launch before, "
                   "and its wait after, independent work such as the experts' weight gradients)")
    p.add_argument("--one-gpu", action=argparse.BooleanOptionalAction, default=True,
                   help="the dense model and the MoE at ep=1 on rank 0's GPU alone in every mode (one_gpu_*), and "
                        "every run's tokens/s per GPU over theirs in its own mode (per_gpu_efficiency_same_mode)")
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="models to time, comma-separated (e.g. dense,moe_ep1,moe_ep2; default all)")
    p.add_argument("--shape", choices=["8x2816-top2", "qwen3-30b-a3b"], default="8x2816-top2",
                   help="the MoE and its dense peer of equal active FLOPs (see above)")
    p.add_argument("--capacity", type=float, default=1.25,
                   help="the 8x2816-top2 MoE's capacity factor (0: dropless, no choice dropped; then no extra "
                        "_dropless run)")
    p.add_argument("--smoke", action="store_true", help="2 CPU processes (gloo), tiny shapes, 2 steps")
    p.add_argument("--out", help="also write the JSON here (rank 0)")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.parity_steps = min(args.steps, 2), min(args.warmup, 1), min(args.parity_steps, 3)
        args.instrumented_steps = min(args.instrumented_steps, 1)
    if "RANK" in os.environ:
        return in_job(worker, args)
    if not args.smoke:
        sys.exit("launch the GPU measurement with torchrun, e.g. torchrun --nproc-per-node 2 bench/moe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    env = job_env(OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


if __name__ == "__main__":
    main()
