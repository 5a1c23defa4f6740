"""Mixture of experts under expert parallelism: an 8-expert top-2 model against the dense model with
the same active FLOPs, in one torchrun job.

    torchrun --nproc-per-node 2 bench/moe.py          # 2 GPUs, ep=2 (--ep N: any ep dividing the GPUs)
    python bench/moe.py --smoke                       # 2 CPU processes over gloo, tiny shapes: checks the script

Model (GPU): Llama-style, d_model 2048, 8 blocks, 16 heads (8 key/value), 32k vocab, 2048 tokens per
sequence, bf16 autocast. MoE: every block's MLP is 8 SwiGLU experts of width 2816, top-2
(`softmax-topk`, capacity factor 1.25); dense: one SwiGLU MLP of width 5632, so a token multiplies
the same weights (plus the MoE router's 8 x 2048). Both run data parallel over every rank (the MoE
with its experts spread over `--ep` of them), AdamW, on random tokens.

First a parity check: 10 steps of the MoE at ep against one process on rank 0's GPU training the same
global batches (every step's loss; the GPU run is bf16, so expect ~1e-2 relative, as bench/multi_gpu.py
allows; the fp32 smoke run is exact to ~1e-6).

Reported (one JSON object, rank 0): `parity`; for each model tokens/s over all ranks, MFU of the active FLOPs
(PaLM 6N + 12LHQT with N the active matmul weights, as the trainer counts it), step time; for the
MoE the all-to-all's share of the step (dispatch, combine and their backward, timed with the device
synchronized around each exchange in separate, instrumented steps) and the share of routed choices
dropped for capacity; and `moe_vs_dense`, the MoE's tokens/s over the dense model's (target >= 0.8).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device machines require.
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
from common import fresh_memory, summarize, time_steps  # puts the checkout on sys.path

from teratrain.config import load_config  # noqa: E402
from teratrain.mesh import Runtime, init_runtime, pick_device  # noqa: E402
from teratrain.models.moe import moe_layers  # noqa: E402
from teratrain.models.transformer import Transformer, count_params, flops_per_token  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.parallel import comm, expert  # noqa: E402
from teratrain.parallel.comm import AVG, MAX, all_reduce  # noqa: E402
from teratrain.parallel.parallelize import parallelize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPU = ["model.n_layers=8", "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=8", "model.vocab_size=32000",
       "model.seq_len=2048", "train.micro_batch=4", "memory.precision=bf16"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
         "model.seq_len=32", "train.micro_batch=2", "memory.precision=fp32", "train.device=cpu"]
EXPERT_FF = {"gpu": 2816, "smoke": 64}


def models(smoke: bool, ep: int) -> dict[str, list[str]]:
    ff = EXPERT_FF["smoke" if smoke else "gpu"]
    moe = [f"model.d_ff={ff}", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.router=softmax-topk",
           "model.moe.capacity_factor=1.25", f"parallel.ep={ep}"]
    return {"moe": moe, "dense": [f"model.d_ff={2 * ff}"]}


def build(sets: list[str], single: bool = False):
    """(cfg, runtime, model, engine) through parallelize(); `single`: one process on this rank's
    device (the reference of the parity check), whatever the job's size."""
    cfg = load_config(None, sets + ["optim.warmup_steps=0", "metrics.progress=false"] + (["parallel.ep=1"] if single else []))
    rt = Runtime.single(pick_device(cfg.train.device, int(os.environ["LOCAL_RANK"]))) if single else init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    torch.manual_seed(cfg.train.seed + rt.dp_rank)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return cfg, rt, model, parallelize(model, rt, cfg)


def parity(sets: list[str], steps: int) -> dict | None:
    """Every step's loss of the job (experts over ep ranks) against one process on rank 0 training
    the same global batches (random tokens), as micro-batches in the same order. Rank 0 returns it."""
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
        ref = _losses(*build(sets, single=True), batches)
        err = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        out = {"steps": steps, "max_rel_loss_diff": err, "losses": got, "one_process": ref}
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


def measure(sets: list[str], steps: int, warmup: int, instrument: bool) -> dict:
    """Build one model through parallelize() and time its optimizer steps on random tokens."""
    cfg, rt, model, engine = build(sets)
    tc, m = cfg.train, cfg.model
    num_micro = tc.global_batch // (tc.micro_batch * rt.dims.dp)
    data = torch.randint(0, m.vocab_size, (num_micro, tc.micro_batch, m.seq_len + 1), device=rt.device)
    micro = [(b[:, :-1], b[:, 1:]) for b in data]

    def step():
        train_step(model, engine, micro, cfg.memory.precision, cfg.optim.lr)

    times = time_steps(step, warmup, steps, rt.device)
    tokens = tc.global_batch * m.seq_len
    out = summarize(times, tokens, flops_per_token(m), rt.device, cfg.memory.precision)
    out["mfu"] = round(out["mfu"] / rt.dims.workers, 4) if out["mfu"] else None  # peak of every rank
    out["step_ms_max_rank"] = _max_over_ranks(out["step_ms"], rt)
    for _, layer in moe_layers(model):
        layer.pop_stats()
    if instrument and moe_layers(model):
        exchanged = [0.0]
        with _timed_all_to_all(exchanged, rt.device):
            step_s = sum(time_steps(step, 0, steps, rt.device))
        out["all_to_all_share"] = round(exchanged[0] / step_s, 4)
        stats = [layer.pop_stats() for _, layer in moe_layers(model)]
        dropped = sum(float(s["dropped"]) for s in stats) / max(1.0, sum(float(s["attempted"]) for s in stats))
        out["dropped"] = round(dropped, 4)
    out["active_params"], out["params"] = count_params(m)["active"], count_params(m)["total"]
    del model, engine
    return out


@contextlib.contextmanager
def _timed_all_to_all(acc: list[float], device: torch.device):
    """Time every all-to-all (the counts exchange and both row exchanges, forward and backward)
    with the device synchronized before and after it."""
    original = comm.all_to_all

    def timed(*args, **kwargs):
        _sync(device)
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        _sync(device)
        acc[0] += time.perf_counter() - t0
        return result

    comm.all_to_all = expert.all_to_all = timed
    try:
        yield
    finally:
        comm.all_to_all = expert.all_to_all = original


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, rt) -> float:
    t = torch.tensor([value], device=rt.device, dtype=torch.float64)
    all_reduce(t, rt.group("world"), op=MAX)
    return float(t)


def worker(args) -> None:
    for key, value in NO_MULTICAST.items():  # before NCCL starts
        os.environ.setdefault(key, value)
    world = int(os.environ["WORLD_SIZE"])
    base = (SMOKE if args.smoke else GPU) + [f"train.global_batch={args.global_batch or 2 * world * (1 if args.smoke else 4)}"]
    moe_sets = base + models(args.smoke, args.ep)["moe"]
    check = parity(moe_sets, args.parity_steps)
    results = {name: measure(base + sets, args.steps, args.warmup, name == "moe")
               for name, sets in models(args.smoke, args.ep).items()}
    if int(os.environ["RANK"]) == 0:
        ratio = results["moe"]["tokens_per_s"] / results["dense"]["tokens_per_s"]
        print(json.dumps({"world": world, "ep": args.ep, "smoke": args.smoke, "torch": torch.__version__,
                          "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
                          "parity": check, **results, "moe_vs_dense": round(ratio, 4)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (divides the process count)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks")
    p.add_argument("--parity-steps", type=int, default=10, help="steps of the loss check against one process")
    p.add_argument("--smoke", action="store_true", help="2 CPU processes (gloo), tiny shapes, 2 steps")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.parity_steps = min(args.steps, 2), min(args.warmup, 1), min(args.parity_steps, 3)
    if "RANK" in os.environ:
        worker(args)
        return
    if not args.smoke:
        sys.exit("launch the GPU measurement with torchrun, e.g. torchrun --nproc-per-node 2 bench/moe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


if __name__ == "__main__":
    main()
