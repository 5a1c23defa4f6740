"""What a pipeline step keeps alive, per stage and action, counted on CPU (no GPU needed):
1F1B against ZB-H1 (ZB-H1's aim: no more than 1F1B's peak + 10%).

    python bench/pipeline_live.py              # 4 gloo processes, llama-1b's proportions scaled down
    python bench/pipeline_live.py --account    # and after each action, the live bytes by kind (live_account.py)
    python bench/pipeline_live.py --layers 16  # 4 blocks a stage, as bench/pipeline.py's model on 4 x H100
    python bench/pipeline_live.py --smoke      # 2 processes, tiny: checks the script

Every tensor storage the step allocates is registered by a TorchDispatchMode (each op's outputs,
the receive buffers, autograd's saved tensors and gradients alike) and counted while alive
(StorageWeakRef): after each action, the bytes the step holds, and the step's high-water mark over
every op (what torch.cuda.max_memory_allocated counts on a GPU, less the model states made before
the step). The second of two steps is measured, so gradients and optimizer moments already exist.
Model: llama-1b's shape ratios (d_ff = 4 d, 4 query heads per KV head, vocab = 15.6 d, micro-batch 2),
bf16 autocast over fp32 weights, as bench/pipeline.py and bench/layouts.py run them; one JSON object
with, per schedule and rank, the peak and the bytes held after every action.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from live_account import account  # noqa: E402

MIB = 2**20
FULL = ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=2", "model.d_ff=1024", "model.vocab_size=4000",
        "model.seq_len=256", "model.n_layers=8", "train.micro_batch=2"]
SMOKE = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256", "model.vocab_size=500",
         "model.seq_len=32", "model.n_layers=4", "train.micro_batch=2"]
COMMON = ["memory.precision=bf16", "train.device=cpu", "model.tie_embeddings=true"]


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made under it that are still alive; the most at any op's end."""

    def __init__(self, params: set[int] = frozenset()):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.action_peak = 0
        self.params, self.casts = params, set()  # parameters' storages; live copies of them in another dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place result: its storage is counted where it was made (or predates the step)
        cast = func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.params
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() not in self.refs or self.refs[s.data_ptr()][0].expired():
                    self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                    (self.casts.add if cast else self.casts.discard)(s.data_ptr())
        now = self.now()
        self.peak, self.action_peak = max(self.peak, now), max(self.action_peak, now)
        return out

    def now(self) -> int:
        dead = [k for k, (ref, _) in self.refs.items() if ref.expired()]
        for k in dead:
            del self.refs[k]
        return sum(n for _, n in self.refs.values())


def measure(sets: list[str], schedule: str, m: int, by_kind: bool = False) -> dict:
    """Two steps of `schedule` with m micro-batches; the second one's live bytes on this rank (with
    `by_kind`, after each action also by kind, live_account.py, and the most held during it)."""
    from pipeline import build, micro_batches

    from teratrain.parallel.pipeline import runtime as rt_mod

    cfg, rt, model, engine = build(sets + [f"parallel.schedule={schedule}", f"train.global_batch={m * 2}"])
    step = rt_mod.step_runner(model, engine, rt, cfg)
    micro = micro_batches(cfg, m, rt.device)
    step(micro, cfg.memory.precision, 1e-4)
    trace, compute = [], rt_mod._Call._compute
    mode = LiveBytes({p.untyped_storage().data_ptr() for p in model.parameters()})

    def counted(call, i, a):
        mode.action_peak = 0
        compute(call, i, a)
        row = [f"{a.kind}{a.microbatch}", round(mode.now() / MIB, 3)]
        if by_kind:
            row += [round(mode.action_peak / MIB, 3), account(call, mode.refs, mode.casts, cfg.model.vocab_size)]
        trace.append(row)

    rt_mod._Call._compute = counted
    try:
        with mode:
            step(micro, cfg.memory.precision, 1e-4)
    finally:
        rt_mod._Call._compute = compute
    key = "after_each_action_mib" + ("_peak_during_by_kind" if by_kind else "")
    return {"peak_mib": round(mode.peak / MIB, 3), key: trace}


def worker(args) -> None:
    import torch.distributed as dist

    sets = (SMOKE if args.smoke else FULL) + COMMON + [f"parallel.pp={int(os.environ['WORLD_SIZE'])}"]
    if args.layers:
        sets.append(f"model.n_layers={args.layers}")
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        for m in args.microbatches:
            mine = measure(sets, schedule, m, args.account)  # the first builds the runtime (process groups)
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, mine)
            out[f"{schedule} m={m}"] = got
    if dist.get_rank() == 0:
        pp = dist.get_world_size()
        summary = {k: [r["peak_mib"] for r in v] for k, v in out.items()}
        ratio = {f"m={m}": round(max(summary[f"zb-h1 m={m}"]) / max(summary[f"1f1b m={m}"]), 3) for m in args.microbatches}
        text = json.dumps({"bench": "pipeline_live", "pp": pp, "model": sets, "torch": torch.__version__,
                           "peak_mib_per_rank": summary, "zb_over_1f1b_fullest_rank": ratio, "ranks": out}, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--layers", type=int, help="model.n_layers (default 8; 4 with --smoke)")
    ap.add_argument("--account", action="store_true", help="after each action, the live bytes by kind (live_account.py)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        torch.set_num_threads(1)
        worker(args)
        return
    n = 2 if args.smoke else args.pp
    extra = ["--microbatches", "4"] if args.smoke else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           *sys.argv[1:], *extra]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
