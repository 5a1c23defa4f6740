"""planner/time.py MOE_HOST_OP_SHARE: the host's time per op of an MoE layer's own ops, in dense ops.

The host's time per aten op of an MoE block's own ops against a dense block's; prints one JSON object.

    python bench/calibrate/moe_host_ops.py [--rounds 15] [--out moe_host_ops.json]     # CPU, ~10 s

One Llama block at a width where every kernel costs next to nothing (d 16, 8 tokens), forward and backward
under bf16 autocast, dense and with an MoE MLP (4 experts, top-2, the grouped kernel), timed in
interleaved rounds of 50 steps on one CPU thread; the ops are counted with a dispatch mode. The host
probe of bench/planner_validate.py times a dense model only, and the planner prices every op at its
fitted cost per op (planner/time.py host_s); this measures whether an MoE layer's extra ops
(planner/time.py OPS_MOE_EXTRA) cost more each, which MOE_HOST_OP_SHARE charges. `extra_op_share`:
(MoE block - dense block) seconds per extra op over the dense block's seconds per op, at the fastest
round of each. CPU only: on a GPU host each op also pays its kernel launch, which both kinds share.
The constant itself is fitted on the recorded validations' MoE rows; this ratio is what it stands for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common
from common import count_ops, emit  # noqa: E402  (it puts the checkout on the path)

from teratrain.config import load_config  # noqa: E402
from teratrain.models.layers import Positions, Rotary  # noqa: E402
from teratrain.models.transformer import Block  # noqa: E402

SHAPE = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=16",
         "model.seq_len=8"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


def block_step(extra: list[str], prepare=None):
    """A forward and backward of one block (`prepare(block)` first, if given), and the aten ops it issues."""
    cfg = load_config(None, SHAPE + extra).model
    torch.manual_seed(0)
    block = Block(cfg, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    for m in block.modules():
        if getattr(m, "kernel", None) == "auto":
            m.kernel = "grouped"
    if prepare is not None:
        prepare(block)
    rotary = Rotary(cfg.head_width, cfg.seq_len, cfg.rope_theta)
    rotary.reset()
    rope, x = rotary(0, cfg.seq_len), torch.randn(1, cfg.seq_len, cfg.d_model, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(x, Positions(rope))
        y.float().sum().backward()

    step()
    return step, count_ops(step)


def timed_per_op(blocks: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per op of each block's step ({name: (step, ops)}, built on one CPU thread), a list of rounds
    each, the blocks interleaved within every round."""
    per_op = {k: [] for k in blocks}
    for _ in range(rounds):
        for name, (step, ops) in blocks.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            per_op[name].append((time.perf_counter() - t0) / calls / ops)
    return per_op


def extra_op_share(base: float, base_ops: int, other: float, other_ops: int) -> float:
    """The host's seconds per op of what `other`'s block issues beyond `base`'s, over `base`'s per op."""
    return (other * other_ops - base * base_ops) / (other_ops - base_ops) / base


def compare(steps: dict, rounds: int, calls: int) -> dict:
    """Two blocks' steps ({name: a builder of (step, ops)}, the base first) timed against each other on one
    CPU thread: their ops, microseconds per op (fastest and median round) and `extra_op_share`."""
    torch.set_num_threads(1)  # before the blocks' first steps: a change of the thread pool costs the next ops
    blocks = {name: build() for name, build in steps.items()}
    per_op = timed_per_op(blocks, rounds, calls)
    (base, (_, base_ops)), (other, (_, other_ops)) = blocks.items()
    fastest = {k: min(v) for k, v in per_op.items()}
    return {"torch": torch.__version__, "ops": {base: base_ops, other: other_ops},
            "us_per_op_fastest": {k: round(v * 1e6, 3) for k, v in fastest.items()},
            "us_per_op_median": {k: round(statistics.median(v) * 1e6, 3) for k, v in per_op.items()},
            "extra_op_share": round(extra_op_share(fastest[base], base_ops, fastest[other], other_ops), 3)}


def measure(rounds: int = 15, calls: int = 50) -> dict:
    return {"bench": "moe_host_ops", **compare({"dense": lambda: block_step([]), "moe": lambda: block_step(MOE)},
                                               rounds, calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    emit(measure(args.rounds), args.out)


if __name__ == "__main__":
    main()
