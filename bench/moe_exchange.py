"""The expert exchange alone, at the shapes of bench/moe.py's ep runs: what one MoE layer's dispatch
all-to-all costs with nothing else on the GPUs, and what sending only the routed rows would cost.

bench/moe.py's graphed ep=4 step spends 18% of its time in all-to-all kernels (bench/README.md). A
kernel's time there is its transfer plus its wait for the last peer to arrive; this bench has no
compute between exchanges, so what it times is the transfer. Rows, each one dispatch of every rank's
routed choices (the combine moves the same rows back):
- padded: NCCL `all_to_all_single` of every expert's capacity, used or not (parallel/expert.py's
  exchange with a capacity: fixed sizes, no read-back, what runs in a CUDA graph today);
- exact: NCCL with only the routed rows (split sizes on the host, as the dropless exchange reads them
  back, which a CUDA graph cannot);
- padded, N CTAs (`--ctas`): the padded exchange with NCCL's thread blocks pinned to N;
- device: NVSHMEM's `all_to_all_vdev_2d` (torch symmetric memory) with only the routed rows and the
  split sizes on the device, and its combine (`all_to_all_vdev_2d_offset`): what a padding-free
  exchange inside a CUDA graph would use, where torch's NVSHMEM is available.
Routing: K distinct experts per token drawn from a skewed distribution shared by the ranks (a
random-init router's common bias), cut at the capacity as GShard does; `--skew` sets the drop rate
(the default 1.2 drops 28-29%, what bench/moe.py's ep=4 runs dropped: 26-31%). Each time is the mean of `--iters`
back-to-back calls after 3 warm-up calls, the slowest rank's (bench/machine.py
`time_calls`; the session-13 files timed each call with CUDA events after a barrier, the median).

    torchrun --nproc-per-node 4 bench/moe_exchange.py --out results/moe_exchange.json
    python -m torch.distributed.run --nproc-per-node 2 bench/moe_exchange.py --smoke     # gloo, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit
from machine import time_calls

from teratrain.compat import nccl_options
from teratrain.models.moe import capacity_rows


def routed_counts(tokens: int, k: int, experts: int, capacity: float, skew: float, rank: int) -> tuple[torch.Tensor, float]:
    """Rows this rank sends each global expert (within capacity) and the share of choices dropped."""
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(0)) * skew  # shared by the ranks
    probs = torch.softmax(bias, 0).expand(tokens, -1)
    choices = torch.multinomial(probs, k, generator=torch.Generator().manual_seed(1 + rank))  # k distinct
    wanted = torch.bincount(choices.flatten(), minlength=experts)
    slot = capacity_rows(tokens, k, experts, capacity, 1)
    kept = wanted.clamp(max=slot)
    return kept, 1 - kept.sum().item() / (tokens * k)


def row(name: str, seconds: float, rows_sent: int, d: int, itemsize: int, world: int) -> dict:
    nbytes = rows_sent * d * itemsize
    return {"name": name, "ms": round(seconds * 1e3, 4), "rows_sent": rows_sent, "mib_sent": round(nbytes / 2**20, 2),
            "off_rank_gbps": round(nbytes * (world - 1) / world / seconds / 1e9, 1)}


def nvshmem_rows(x: torch.Tensor, kept: torch.Tensor, local: int, slot: int, iters: int, world: int,
                 expect_sum: float) -> list[dict]:
    """Dispatch and combine through NVSHMEM's device-split all-to-all (rows, or one row with the error)."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return [{"name": "device", "error": "torch reports NVSHMEM unavailable on this machine"}]
    symm_mem.set_backend("NVSHMEM")
    group = dist.group.WORLD.group_name
    n, d, dev = kept.numel(), x.shape[1], x.device

    def alloc(shape, dtype):
        t = symm_mem.empty(shape, dtype=dtype, device=dev)
        symm_mem.rendezvous(t, group)
        return t

    inp, got = alloc(x.shape, x.dtype), alloc((world * local * slot, d), x.dtype)
    back = alloc(x.shape, x.dtype)
    splits = alloc((n,), torch.int64)
    got_so, back_so = alloc((2, n), torch.int64), alloc((2, n), torch.int64)
    inp.copy_(x)
    splits.copy_(kept.to(dev))
    sent = int(kept.sum())

    def dispatch():
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, got, splits, got_so, group, major_align=1)

    def combine():
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(got, back, got_so, back_so, group)

    t_d = time_calls(dispatch, dev, iters)
    dispatch()
    torch.cuda.synchronize(dev)
    received = int(got_so[0].sum())
    checksum = got[:received].float().sum()
    dist.all_reduce(checksum)
    t_c = time_calls(combine, dev, iters)
    combine()
    torch.cuda.synchronize(dev)
    same = torch.equal(back[:sent], x[:sent])  # the combine brings every sent row back in place
    return [{**row("device dispatch (NVSHMEM vdev_2d)", t_d, sent, d, x.element_size(), world), "received": received,
             "checksum_matches_nccl": bool(abs(float(checksum) - expect_sum) <= 1e-3 * max(1.0, abs(expect_sum)))},
            {**row("device combine (NVSHMEM vdev_2d_offset)", t_c, sent, d, x.element_size(), world),
             "rows_back_in_place": bool(same)}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a rank routes per micro-batch (moe.py: 4 x 2048)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=1.25)
    ap.add_argument("--skew", type=float, default=1.2, help="spread of the experts' shared routing bias")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ctas", default="", help="also the padded exchange with NCCL pinned to these thread-block "
                                               "counts (ncclConfig_t min/maxCTAs), e.g. 8,16,32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.smoke:
        args.tokens, args.d_model, args.iters = 256, 64, 3
    n, k, d = args.experts, args.k, args.d_model
    if n % world:
        raise SystemExit(f"--experts ({n}) must be a multiple of the ranks ({world})")
    local, dtype = n // world, torch.bfloat16 if cuda else torch.float32
    slot = capacity_rows(args.tokens, k, n, args.capacity, 1)  # one local group, as bench/moe.py's runs
    kept, dropped = routed_counts(args.tokens, k, n, args.capacity, args.skew, rank)
    sent = int(kept.sum())
    x = torch.randn(args.tokens * k, d, generator=torch.Generator().manual_seed(rank)).to(dev, dtype)

    padded_in, padded_out = torch.zeros(n * slot, d, dtype=dtype, device=dev), torch.empty(n * slot, d, dtype=dtype, device=dev)
    pad = [local * slot] * world
    rows = [row("padded (NCCL, every slot)", time_calls(lambda: dist.all_to_all_single(padded_out, padded_in, pad, pad), dev, args.iters),
                n * slot, d, x.element_size(), world)]
    for ctas in [int(c) for c in args.ctas.split(",") if c] if cuda else []:  # NCCL's thread blocks pinned
        group = dist.new_group(list(range(world)), pg_options=nccl_options(ctas, min_ctas=ctas))
        rows.append({**row(f"padded (NCCL, {ctas} CTAs)", time_calls(
            lambda: dist.all_to_all_single(padded_out, padded_in, pad, pad, group=group), dev, args.iters),
            n * slot, d, x.element_size(), world), "ctas": ctas})

    to_peer = kept.view(world, local).sum(1)
    counts = torch.empty(world, dtype=torch.int64, device=dev)
    dist.all_to_all_single(counts, to_peer.to(dev))
    send_splits, recv_splits = to_peer.tolist(), counts.tolist()
    most = torch.tensor([sum(recv_splits)], device=dev)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the busiest receiver's rows: its exchange takes longest
    exact_out = torch.empty(sum(recv_splits), d, dtype=dtype, device=dev)
    exact_in = x[:sent]
    rows.append(row("exact (NCCL, host splits)", time_calls(
        lambda: dist.all_to_all_single(exact_out, exact_in, recv_splits, send_splits), dev, args.iters),
        sent, d, x.element_size(), world))
    checksum = exact_out.float().sum()
    dist.all_reduce(checksum)
    sent_sum = exact_in.float().sum()
    dist.all_reduce(sent_sum)  # every row sent arrives once: the sums over all ranks agree
    rows[-1]["rows_arrive_once"] = bool(abs(float(checksum) - float(sent_sum)) <= 1e-3 * max(1.0, abs(float(sent_sum))))
    if cuda:
        try:
            rows += nvshmem_rows(x, kept, local, slot, args.iters, world, float(checksum))
        except Exception as e:  # noqa: BLE001 - the other rows stand; the reason is reported
            rows.append({"name": "device", "error": f"{type(e).__name__}: {e}"[:400]})
    share = torch.tensor([dropped, sent / (n * slot)], dtype=torch.float64, device=dev)
    dist.all_reduce(share)
    out = {"bench": "moe_exchange", "world": world, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "tokens_per_rank": args.tokens,
           "d_model": d, "experts": n, "k": k, "capacity": args.capacity, "slot_rows": slot,
           "dropped": round(float(share[0]) / world, 4), "slots_used": round(float(share[1]) / world, 4),
           "most_rows_received": int(most), "rows": rows}
    if rank == 0:
        emit(out, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
