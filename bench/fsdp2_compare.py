"""Our ZeRO-3 against PyTorch FSDP2 (`fully_shard`) on the same model, shape and batch, under torchrun;
rank 0 prints one JSON object (and writes it with --out).

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 bench/fsdp2_compare.py --out fsdp2.json
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --smoke     # gloo CPU processes, tiny shape
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --compile   # + both sides compiled block by block
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --profile   # + each side's kernel account (torch.profiler)
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --copy-per-tensor   # + ours with a copy_ per tensor (A/B)
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --rounds 3   # each side 3 times, order alternated: median ratio
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --dp-max-ctas 16,8 --fsdp2-max-ctas 8   # + NCCL capped
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --compile --fp8 tensorwise   # + both sides in float8
    torchrun --nproc-per-node 2 bench/fsdp2_compare.py --smoke --fp8 tensorwise     # float8 GEMMs emulated

Both shard every block and the root over all ranks, compute in bf16 with fp32 master weights and an
fp32 gradient reduction, use fused AdamW and clip at 1.0, and see the same random tokens. Llama-8B
(32k vocabulary, seq 4096, micro-batch 1) is cut to the most blocks whose planned peak (our planner,
ZeRO-3 at this dp) fits 75% of the GPU found (H100 80 GB, H200 141 GB), the same for both sides.
Each side: build, 3 warm-up steps, `--steps` timed steps, then one step with allocation tracing
(bench/memory_trace.py): the peak and the largest allocation sites alive at it, next to the peak
allocated/reserved of the whole run, and the model states each side holds. `--compile`: both once more
with each block's forward compiled (ours: train.compile under ZeRO-3, its gather/free hooks eager
around each block, and the final norm and the loss; FSDP2: torchtitan's order, `torch.compile` on each
block, then `fully_shard`, and the final norm and the loss compiled too). `--fp8 RECIPE`: both once more
per mode with the block linears in float8 (ours: memory.fp8, gathering float8 weights under tensorwise,
memory.fp8_gather; FSDP2: torchtitan's torchao float8 training, common.py `torchao_float8`), reported
as `*_fp8` rows, ours against FSDP2 both in float8 as `tokens_per_s_ratio_ours_over_fsdp2_fp8` (compiled:
`_compiled_fp8`) beside the bf16 ratios, and per mode `fp8` / `fp8_compiled`: each side's float8 against its
bf16 and the four peaks. --smoke emulates the float8 GEMMs on both sides (torchao's emulation,
memory.fp8_emulate); FSDP2's float8 all-gather runs on gloo as it is.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fit_layers, fresh_compile, smoke_compile, torchao_float8  # noqa: E402
from memory_trace import traced_step  # noqa: E402
from trace_summary import profile_steps  # noqa: E402
from teratrain.compat import nccl_options  # noqa: E402
from teratrain.config import load_config  # noqa: E402
from teratrain.memory.fp8 import RECIPES, fp8_problem, gathers_in_float8  # noqa: E402
from teratrain.mesh import init_runtime, shutdown  # noqa: E402
from teratrain.models.transformer import Transformer, flops_per_token  # noqa: E402
from teratrain.optim.engine import tensor_bytes, train_step  # noqa: E402
from teratrain.parallel.parallelize import parallelize  # noqa: E402

SHAPES = {"llama-8b": ["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"],
          "llama-1b": ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048"]}
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=512"]
RUN = ["memory.precision=bf16", "parallel.zero=3"]
GIB = 2**30
FIT = 0.75  # of the GPU's memory for the planned peak: room for FSDP2's own buffers and the allocator's


def ours(cfg, rt):
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)

    def step(x, y):
        train_step(model, engine, [(x, y)], "bf16", 1e-4)

    def states() -> int:
        held = engine.last_state_bytes
        return held["params"] + held["grads"] + held["optimizer"]

    return step, states


def ours_copy_per_tensor(cfg, rt):
    """Ours with one `copy_` per gradient into the reduce inputs instead of `FlatGroup.flatten`'s one
    `_foreach_copy_` (the A/B of --copy-per-tensor): `_foreach_copy_` swapped for that loop during our
    step, where at dp > 1 flatten is its only caller."""
    step, states = ours(cfg, rt)

    def patched(x, y):
        foreach = torch._foreach_copy_
        torch._foreach_copy_ = lambda dsts, srcs: [d.copy_(s) for d, s in zip(dsts, srcs)]
        try:
            step(x, y)
        finally:
            torch._foreach_copy_ = foreach

    return patched, states


def fsdp2(cfg, rt, group=None):
    """FSDP2 over every rank: the default group, or `group` (--fsdp2-max-ctas: one whose NCCL
    collectives are capped as parallel.dp_max_ctas caps ours)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = (init_device_mesh(rt.device.type, (rt.world,)) if group is None
            else DeviceMesh.from_group(group, rt.device.type))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    float8 = None
    if cfg.memory.fp8 != "none":  # before compiling and sharding; tensorwise gathers float8 weights, as ours does
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        float8 = torchao_float8(model, cfg, enable_fsdp_float8_all_gather=cfg.memory.fp8 == "tensorwise")
    if cfg.train.compile:  # torchtitan's order: each block compiled, then sharded (its hooks outside the graph)
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block)
        model.norm.compile()  # and, as ours (parallelize.compile_units) and torchtitan's loss, the final norm
        model.criterion.compile()  # and the loss: a fused pass over the logits
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=rt.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, cfg.model.init_std)
    model.init_buffers(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=rt.device.type == "cuda")
    held = {}

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not held:  # as ours counts them: sharded params (the fp32 masters), grads before the update
            local = [_unwrapped(p.to_local()) for p in model.parameters()]
            held["states"] = tensor_bytes(local) + tensor_bytes(p.grad.to_local() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if float8 is not None and float8.enable_fsdp_float8_all_gather:  # torchtitan: after every optimizer step,
            precompute_float8_dynamic_scale_for_fsdp(model)  # the weights' scales in one all-reduce, for the gathers

    def states() -> int:
        moments = [t.to_local() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
        return held["states"] + tensor_bytes(moments)

    return step, states


def measure(build, cfg, rt, mb: int, warmup: int, steps: int, top: int = 12, profile: bool = False) -> dict:
    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rt.device)
    start = torch.cuda.memory_allocated(rt.device) if rt.device.type == "cuda" else 0
    step, states = build(cfg, rt)
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=g).to(rt.device)
    times = []
    for i in range(warmup + steps):
        _sync(rt)
        dist.barrier()
        t0 = time.perf_counter()
        step(x[:, :-1], x[:, 1:])
        _sync(rt)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = _max_over_ranks(torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else 0, rt)
    reserved = _max_over_ranks(torch.cuda.max_memory_reserved(rt.device) if rt.device.type == "cuda" else 0, rt)
    dist.barrier()
    trace = traced_step(lambda: step(x[:, :-1], x[:, 1:]), rt.device, top)
    tps = mb * cfg.model.seq_len * rt.world / statistics.median(times)
    row = {"tokens_per_s": tps, "tflops_per_gpu": tps * flops_per_token(cfg.model) / rt.world / 1e12,
           "step_ms": 1e3 * statistics.median(times), "peak_gib_max_over_ranks": peak / GIB,
           "reserved_gib_max_over_ranks": reserved / GIB, "model_state_gib": states() / GIB,
           "allocated_gib_before_build": start / GIB, "traced_step_rank0": trace}
    if profile:
        row["profile"] = profile_steps(lambda: step(x[:, :-1], x[:, 1:]), rt.device)
    return row


def _ratios(rows: dict, ours_key: str, peer_key: str, tag: str) -> None:
    """First round's ratios; with --rounds > 1 also the ratio of the rounds' median tokens/s, and each
    round's own ratio."""
    a, b = rows[ours_key], rows[peer_key]
    rows[f"tokens_per_s_ratio_ours_over_fsdp2{tag}"] = a["tokens_per_s"] / b["tokens_per_s"]
    rows[f"peak_ratio_ours_over_fsdp2{tag}"] = a["peak_gib_max_over_ranks"] / max(b["peak_gib_max_over_ranks"], 1e-9)
    ra, rb = a["tokens_per_s_rounds"], b["tokens_per_s_rounds"]
    if len(ra) > 1:
        rows[f"tokens_per_s_ratio_ours_over_fsdp2{tag}_median"] = statistics.median(ra) / statistics.median(rb)
        rows[f"tokens_per_s_ratio_ours_over_fsdp2{tag}_rounds"] = [round(x / y, 4) for x, y in zip(ra, rb)]


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass (torchao's float8 weight, whose storage cannot be read), else t."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return getattr(t, t.__tensor_flatten__()[0][0]) if is_traceable_wrapper_subclass(t) else t


def _fp8_summary(rows: dict, tag: str, cfg) -> dict:
    """The float8 sides of one mode against their bf16 runs: tokens/s ratios (of the first round, and of the
    rounds' medians with --rounds > 1), each side's peak, and what each gathers in. Ours against FSDP2, both in
    float8, is `_ratios`' (tokens_per_s_ratio_ours_over_fsdp2{tag}_fp8 and its median, rounds and peak ratio)."""
    names = {"ours_fp8": f"ours_zero3{tag}_fp8", "ours_bf16": f"ours_zero3{tag}",
             "fsdp2_fp8": f"fsdp2{tag}_fp8", "fsdp2_bf16": f"fsdp2{tag}"}
    row = {k: rows[v] for k, v in names.items()}
    recipe = cfg.memory.fp8
    out = {"mode": "compiled" if tag else "eager", "recipe": recipe,
           "gathers": {"ours": "float8" if gathers_in_float8(3, recipe, cfg.memory.fp8_gather) else "bf16",
                       "fsdp2": "float8" if recipe == "tensorwise" else "bf16"}}  # torchao: tensorwise only
    for a, b in (("ours_fp8", "ours_bf16"), ("fsdp2_fp8", "fsdp2_bf16")):
        out[f"tokens_per_s_{a}_over_{b}"] = round(row[a]["tokens_per_s"] / row[b]["tokens_per_s"], 4)
        ra, rb = row[a]["tokens_per_s_rounds"], row[b]["tokens_per_s_rounds"]
        if len(ra) > 1:
            out[f"tokens_per_s_{a}_over_{b}_median"] = round(statistics.median(ra) / statistics.median(rb), 4)
    out.update({f"peak_gib_{k}": round(r["peak_gib_max_over_ranks"], 3) for k, r in row.items()})
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _sync(rt) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def _max_over_ranks(value: float, rt) -> float:
    t = torch.tensor([float(value)], device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="also write the JSON here (rank 0)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--layers", type=int, help="blocks of the model (default: as many as fit, see the docstring)")
    ap.add_argument("--set", action="append", default=[], help="a config override on top of the shape")
    ap.add_argument("--compile", action="store_true", help="also both sides with each block compiled")
    ap.add_argument("--compile-only", action="store_true", help="only the compiled runs")
    ap.add_argument("--trace-top", type=int, default=12, help="allocation sites listed at each side's traced peak")
    ap.add_argument("--profile", action="store_true", help="each side's kernel account of 2 steps (torch.profiler: "
                                                           "busy, idle, NCCL exposed, copies, top ops)")
    ap.add_argument("--copy-per-tensor", action="store_true",
                    help="also ours with one copy_ per gradient into the reduce inputs instead of one "
                         "_foreach_copy_: an A/B in the same job")
    ap.add_argument("--dp-max-ctas", default="", help="also ours with parallel.dp_max_ctas at each of these "
                                                       "(comma-separated), each on groups of its own")
    ap.add_argument("--fsdp2-max-ctas", default="", help="also FSDP2 on a group whose NCCL config caps the CTAs "
                                                         "at each of these (comma-separated)")
    ap.add_argument("--fp8", choices=RECIPES, help="also both sides with the block linears in float8 at this "
                                                   "recipe: ours memory.fp8, FSDP2 torchao's float8 training")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every side this many times, each round after the first in the reverse order "
                         "of the one before (unprofiled), and report the ratio of the median tokens/s too")
    args = ap.parse_args()
    if args.smoke and (args.compile or args.compile_only):
        smoke_compile()
    if not args.smoke:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # FSDP2 needs a process group even on one GPU (ours needs none then)
        dist.init_process_group("gloo" if args.smoke else "nccl")
    world = dist.get_world_size()
    batch = [f"train.micro_batch={args.micro_batch}", f"train.global_batch={args.micro_batch * world}"]
    # the float8 sides: on CPU (--smoke) both emulate the float8 GEMMs in high precision
    fp8 = [f"memory.fp8={args.fp8}"] + (["memory.fp8_emulate=true"] if args.smoke else []) if args.fp8 else []
    if args.smoke:
        shape = SMOKE
    else:
        fit = SHAPES[args.model] + RUN + batch
        total = torch.cuda.mem_get_info()[1]  # the float8 sides run the same blocks: the fewer of both fits
        layers = args.layers or min(fit_layers(fit + extra, world, total, FIT) for extra in ([], fp8))
        shape = SHAPES[args.model] + [f"model.n_layers={layers}"]
    shape += args.set
    cfg = load_config(None, shape + RUN + batch)
    rt = init_runtime(cfg)
    why = fp8_problem(args.fp8 or "none", args.smoke, rt.device)
    if why:
        raise SystemExit(why)
    rows = {"fp8_recipe": args.fp8} if args.fp8 else {}

    def run(build, config, side_rt, first: bool = True) -> dict:
        return measure(build, config, side_rt, args.micro_batch, 3, args.steps, args.trace_top, args.profile and first)

    # NCCL-capped variants, each on process groups of its own, made once (every rank, the same order)
    capped_ours = {n: init_runtime(load_config(None, shape + RUN + batch + [f"parallel.dp_max_ctas={n}"]))
                   for n in _ints(args.dp_max_ctas)}
    capped_fsdp2 = {n: dist.new_group(list(range(world)), pg_options=nccl_options(n))
                    for n in _ints(args.fsdp2_max_ctas)}

    modes = [] if args.compile_only else [("", [])]
    if args.compile or args.compile_only:  # both sides compiled, each block apart
        modes.append(("_compiled", ["train.compile=true"]))
    for tag, mode in modes:
        config = load_config(None, shape + RUN + batch + mode)
        sides = [(f"ours_zero3{tag}", ours, rt, config), (f"fsdp2{tag}", fsdp2, rt, config)]
        if args.fp8:  # the same two, each with its block linears in float8
            config_fp8 = load_config(None, shape + RUN + batch + mode + fp8)
            sides += [(f"ours_zero3{tag}_fp8", ours, rt, config_fp8), (f"fsdp2{tag}_fp8", fsdp2, rt, config_fp8)]
        if args.copy_per_tensor:
            sides.append((f"ours_zero3{tag}_copy_per_tensor", ours_copy_per_tensor, rt, config))
        sides += [(f"ours_zero3{tag}_ctas{n}", ours, r, config) for n, r in capped_ours.items()]
        sides += [(f"fsdp2{tag}_ctas{n}", functools.partial(fsdp2, group=g), rt, config)
                  for n, g in capped_fsdp2.items()]
        for r in range(args.rounds):  # each round after the first in the reverse order, unprofiled
            for name, build, side_rt, side_cfg in sides if r % 2 == 0 else sides[::-1]:
                fresh_compile()
                row = run(build, side_cfg, side_rt, first=r == 0)
                if r == 0:
                    rows[name] = row  # the first round's row is the one reported in full
                rows[name].setdefault("tokens_per_s_rounds", []).append(round(row["tokens_per_s"], 1))
        _ratios(rows, f"ours_zero3{tag}", f"fsdp2{tag}", tag)
        if args.fp8:  # like for like: both sides float8, and each side's float8 against its bf16, in this mode
            _ratios(rows, f"ours_zero3{tag}_fp8", f"fsdp2{tag}_fp8", f"{tag}_fp8")
            rows[f"fp8{tag}"] = _fp8_summary(rows, tag, config_fp8)
        if args.copy_per_tensor:
            _ratios(rows, f"ours_zero3{tag}_copy_per_tensor", f"fsdp2{tag}", f"{tag}_copy_per_tensor")
        for n in capped_ours:
            _ratios(rows, f"ours_zero3{tag}_ctas{n}", f"fsdp2{tag}", f"{tag}_ctas{n}")
        for n in capped_fsdp2:  # like for like: both capped the same
            if n in capped_ours:
                _ratios(rows, f"ours_zero3{tag}_ctas{n}", f"fsdp2{tag}_ctas{n}", f"{tag}_both_ctas{n}")
    if rt.rank == 0:
        device = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu"
        text = json.dumps({"bench": "fsdp2_compare", "gpus": rt.world, "device": device, "torch": torch.__version__,
                           "shape": shape, "micro_batch": args.micro_batch, **rows}, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
    shutdown()


if __name__ == "__main__":
    main()
