"""Expert balance of auxiliary-loss-free balancing (model.moe.balance=bias, DeepSeek-V3 sec. 2.1.2)
against the auxiliary loss (balance=aux), the same model, data and steps, on CPU.

    python bench/moe_balance.py --out FILE               # 1000 steps each (CPU: minutes)
    python bench/moe_balance.py --steps 300 --out FILE
    python bench/moe_balance.py --budget-s 500 --out FILE   # as many steps (up to --steps) as fit 500 s
    python bench/moe_balance.py --smoke                  # 4 steps each: checks the script

Model: a tiny Llama-style MoE, 2 blocks of d_model 64 (4 heads), every MLP 64 SwiGLU experts of width
32, top-8 softmax-topk, no capacity limit, trained by `teratrain train`'s loop (teratrain.train.run)
on the default corpus (data.path unset: the standard-library text the trainer builds), seq 64, global
batch 16, AdamW lr 3e-3. balance=aux: aux_loss_weight 0.01; balance=bias: no aux loss, bias_rate 1e-3.

Reported per run, from its metrics.jsonl (the load is the routed tokens of each expert over the
global batch, per MoE layer and step): `max_over_mean`, the busiest expert's load over the mean load,
averaged over the last `--window` steps and the layers (1.0 is perfect balance; `max_over_mean_worst`
is the worst layer-step of the window), the mean training loss over the window (`loss_window`) and
the last step's (`final_loss`), and its wall seconds; then `bias_vs_aux`, the bias run's figures over the aux run's,
and `uniform_floor`: the same ratio where every token picks its k experts uniformly at random (200
draws of one step's tokens), which a balanced router cannot beat at this batch size. The
target DeepSeek-V3 reports: the busiest expert within ~1.2x of the mean, loss no worse than with the
auxiliary loss.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teratrain.config import load_config  # noqa: E402
from teratrain.metrics import read_metrics  # noqa: E402
from teratrain.train import run  # noqa: E402

MODEL = ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=32",
         "model.seq_len=64", "model.moe.num_experts=64", "model.moe.top_k=8", "model.moe.router=softmax-topk",
         "model.moe.capacity_factor=0"]
TRAIN = ["train.global_batch=16", "train.micro_batch=16", "optim.lr=3e-3", "train.eval_batches=0",
         "checkpoint.every=0", "metrics.progress=false"]
BALANCES = {"aux": ["model.moe.balance=aux", "model.moe.aux_loss_weight=0.01"],
            "bias": ["model.moe.balance=bias", "model.moe.bias_rate=1e-3"]}


def balance_of(rows: list[dict], window: int) -> dict:
    """The figures of one run's metrics rows (one per step) over the last `window` steps."""
    last = rows[-window:]
    ratios = [max(m["load"]) / (sum(m["load"]) / len(m["load"])) for r in last for m in r["moe"].values()]
    return {"max_over_mean": statistics.fmean(ratios), "max_over_mean_worst": max(ratios),
            "loss_window": statistics.fmean(r["loss"] for r in last), "final_loss": rows[-1]["loss"],
            "steps": len(rows), "window": len(last)}


def one_run(balance: str, steps: int, window: int, work: Path, extra: list[str]) -> dict:
    sets = MODEL + TRAIN + BALANCES[balance] + [f"train.steps={steps}"] + extra
    t0 = time.perf_counter()
    run(load_config(None, sets), str(work / balance))
    out = balance_of(list(read_metrics(work / balance / "metrics.jsonl")), window)
    return {**out, "seconds": time.perf_counter() - t0, "sets": sets}


def uniform_floor(tokens: int, k: int, n: int, draws: int = 200) -> float:
    """Mean busiest-over-mean load of one step whose `tokens` each pick k of n experts uniformly."""
    g = torch.Generator().manual_seed(0)
    loads = [torch.rand(tokens, n, generator=g).topk(k, -1).indices.flatten().bincount(minlength=n).double()
             for _ in range(draws)]
    return statistics.fmean((c.max() / c.mean()).item() for c in loads)


def affordable_steps(budget_s: float, work: Path, extra: list[str]) -> tuple[int, float]:
    """(steps each of the two runs can take within budget_s, seconds per step): a step's time from a
    run of 12 steps minus one of 2 (the same start-up), as measured here."""
    times = []
    for steps in (2, 12):
        t0 = time.perf_counter()
        run(load_config(None, MODEL + TRAIN + BALANCES["bias"] + [f"train.steps={steps}"] + extra), str(work / f"probe{steps}"))
        times.append(time.perf_counter() - t0)
    per_step = max((times[1] - times[0]) / 10, 1e-3)
    return int((budget_s - 2 * times[0]) / (2 * per_step)), per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    p.add_argument("--window", type=int, default=100, help="last steps the figures average over")
    p.add_argument("--budget-s", type=float, default=None, help="fewer steps than --steps where both runs would "
                   "not fit these seconds (a step timed first)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config key, both runs")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="4 steps each, window 2")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    steps, window = (4, 2) if args.smoke else (args.steps, args.window)
    torch.set_num_threads(args.threads)  # tiny matmuls: more threads only wait on each other
    probe = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.budget_s and not args.smoke:
            fit, per_step = affordable_steps(args.budget_s, Path(tmp), args.set)
            probe = {"budget_s": args.budget_s, "step_s": per_step, "steps_requested": steps}
            steps = max(min(steps, fit), 2 * window)
        runs = {b: one_run(b, steps, window, Path(tmp), args.set) for b in BALANCES}
    a, b = runs["aux"], runs["bias"]
    report = {"bench": "moe_balance", "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), **probe, "runs": runs,
              "bias_vs_aux": {"max_over_mean": b["max_over_mean"] / a["max_over_mean"],
                              "loss_window": b["loss_window"] / a["loss_window"]},
              "uniform_floor": uniform_floor(16 * 64, 8, 64),  # global batch x seq_len tokens, top-8 of 64
              "target_met": b["max_over_mean"] <= 1.2 and b["loss_window"] <= a["loss_window"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
