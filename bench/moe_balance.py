"""Expert balance of auxiliary-loss-free balancing (model.moe.balance=bias, DeepSeek-V3 sec. 2.1.2)
against the auxiliary loss (balance=aux), the same model, data and steps, on CPU.

    python bench/moe_balance.py --out FILE               # aux + bias at 1e-3, 3e-3, 1e-2, 1000 steps each
    python bench/moe_balance.py --rates 1e-3 --steps 300 --out FILE
    python bench/moe_balance.py --budget-s 500 --out FILE   # as many steps (up to --steps) as fit 500 s
    python bench/moe_balance.py --smoke                  # 4 steps each: checks the script

Model: a tiny Llama-style MoE, 2 blocks of d_model 64 (4 heads), every MLP 64 SwiGLU experts of width
32, top-8 softmax-topk, no capacity limit, trained by `teratrain train`'s loop (teratrain.train.run)
on the default corpus (data.path unset: the standard-library text the trainer builds), seq 64, global
batch 16, AdamW lr 3e-3. balance=aux: aux_loss_weight 0.01; balance=bias: no aux loss, one run per
bias rate of `--rates` (default 1e-3, DeepSeek-V3's, then 3e-3 and 1e-2), every run kept in the JSON.

Reported per run, from its metrics.jsonl (the load is the routed tokens of each expert, per MoE layer
and optimizer step, over the whole global batch), both averaged over the layers, worst layer beside:
- `max_over_mean_summed` (the target's figure): the busiest expert's load summed over the last
  `--window` steps over the mean of those sums, 1 + MaxVio_global of Wang et al. 2024 (Loss-Free
  Balancing, sec. 4.1) over the window's 102,400 tokens. The bias moves each expert's expected load;
  at 16 sequences a step, which expert is busiest in one step follows the batch's text (16 runs of
  64 correlated tokens: an expert's per-step load varies 2.4-3x as much as under independent tokens,
  with the aux loss too, and uncorrelated from one step to the next: `load_std_over_independent`,
  `load_lag1_autocorr`), which no update made after the step can undo. DeepSeek-V3's steps hold
  millions of tokens, where the two figures meet.
- `max_over_mean`: the same ratio per step, averaged over the window's steps (`_worst`: the worst
  layer-step), kept as before.
Then the mean training loss over the window (`loss_window`), the last step's (`final_loss`), the wall
seconds; `uniform_floor` and `uniform_floor_summed`: both ratios where every token picks its k experts
uniformly at random (one step's tokens, then the window's), which a balanced router cannot beat.
Target (DeepSeek-V3's claim on this model): `max_over_mean_summed` <= 1.2 with `loss_window` no worse
than the aux run's; `target_met` per bias rate.
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
AUX = ["model.moe.balance=aux", "model.moe.aux_loss_weight=0.01"]
RATES = (1e-3, 3e-3, 1e-2)
TARGET = 1.2  # busiest expert over the mean, load summed over the window (DeepSeek-V3's ~1.2x)


def bias_sets(rate: float) -> list[str]:
    return ["model.moe.balance=bias", f"model.moe.bias_rate={rate:g}"]


def ratio(load: torch.Tensor) -> torch.Tensor:
    """Busiest over mean along the last dim."""
    return load.max(-1).values / load.mean(-1)


def balance_of(rows: list[dict], window: int, k: int) -> dict:
    """The figures of one run's metrics rows (one per step) over the last `window` steps."""
    last = rows[-window:]
    loads = torch.tensor([[m["load"] for m in r["moe"].values()] for r in last], dtype=torch.float64)  # (T, L, n)
    per_step, summed = ratio(loads), ratio(loads.sum(0))  # (T, L), (L,)
    dev = loads - loads.mean(0)  # each expert's step-to-step deviation from its window mean
    mean = loads.mean()  # tokens an expert gets per step on average
    return {"max_over_mean_summed": summed.mean().item(), "max_over_mean_summed_worst": summed.max().item(),
            "max_over_mean": per_step.mean().item(), "max_over_mean_worst": per_step.max().item(),
            # per-step load spread over the multinomial one of independent tokens, and its lag-1 autocorrelation
            "load_std_over_independent": (dev.std(0).mean() / (mean * (1 - k / loads.shape[-1])).sqrt()).item(),
            "load_lag1_autocorr": ((dev[1:] * dev[:-1]).sum() / dev.square().sum()).item(),
            "loss_window": statistics.fmean(r["loss"] for r in last), "final_loss": rows[-1]["loss"],
            "steps": len(rows), "window": len(last)}


def one_run(name: str, balance: list[str], steps: int, window: int, work: Path, extra: list[str]) -> dict:
    sets = MODEL + TRAIN + balance + [f"train.steps={steps}"] + extra
    cfg = load_config(None, sets)
    t0 = time.perf_counter()
    run(cfg, str(work / name))
    out = balance_of(list(read_metrics(work / name / "metrics.jsonl")), window, cfg.model.moe.top_k)
    return {**out, "seconds": time.perf_counter() - t0, "sets": sets}


def uniform_floor(tokens: int, k: int, n: int, draws: int = 200) -> float:
    """Mean busiest-over-mean load of `tokens` tokens that each pick k of n experts uniformly."""
    g = torch.Generator().manual_seed(0)
    loads = [torch.rand(tokens, n, generator=g).topk(k, -1).indices.flatten().bincount(minlength=n).double()
             for _ in range(draws)]
    return statistics.fmean(ratio(c).item() for c in loads)


def affordable_steps(budget_s: float, runs: int, work: Path, extra: list[str]) -> tuple[int, float]:
    """(steps each of the `runs` runs can take within budget_s, seconds per step): a step's time from a
    run of 12 steps minus one of 2 (the same start-up), as measured here."""
    times = []
    for steps in (2, 12):
        t0 = time.perf_counter()
        run(load_config(None, MODEL + TRAIN + bias_sets(RATES[0]) + [f"train.steps={steps}"] + extra),
            str(work / f"probe{steps}"))
        times.append(time.perf_counter() - t0)
    per_step = max((times[1] - times[0]) / 10, 1e-3)
    return int((budget_s - runs * times[0]) / (runs * per_step)), per_step


def verdicts(runs: dict, rates: list[float]) -> dict:
    """Per bias rate: its figures over the aux run's, and whether the target is met."""
    a, out = runs["aux"], {}
    for rate in rates:
        b = runs[f"bias {rate:g}"]
        out[f"bias {rate:g}"] = {
            "summed_vs_aux": b["max_over_mean_summed"] / a["max_over_mean_summed"],
            "per_step_vs_aux": b["max_over_mean"] / a["max_over_mean"],
            "loss_vs_aux": b["loss_window"] / a["loss_window"],
            "target_met": b["max_over_mean_summed"] <= TARGET and b["loss_window"] <= a["loss_window"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    p.add_argument("--window", type=int, default=100, help="last steps the figures average over")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="bias rates, comma-separated")
    p.add_argument("--budget-s", type=float, default=None, help="fewer steps than --steps where all runs would "
                   "not fit these seconds (a step timed first)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config key, every run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="4 steps each, window 2")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    steps, window = (4, 2) if args.smoke else (args.steps, args.window)
    rates = [float(r) for r in args.rates.split(",")]
    torch.set_num_threads(args.threads)  # tiny matmuls: more threads only wait on each other
    cfg = load_config(None, MODEL + TRAIN + args.set)
    tokens, k, n = cfg.train.global_batch * cfg.model.seq_len, cfg.model.moe.top_k, cfg.model.moe.num_experts
    probe = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.budget_s and not args.smoke:
            fit, per_step = affordable_steps(args.budget_s, 1 + len(rates), Path(tmp), args.set)
            probe = {"budget_s": args.budget_s, "step_s": per_step, "steps_requested": steps}
            steps = max(min(steps, fit), 2 * window)
        runs = {"aux": one_run("aux", AUX, steps, window, Path(tmp), args.set)}
        for rate in rates:
            runs[f"bias {rate:g}"] = one_run(f"bias{rate:g}", bias_sets(rate), steps, window, Path(tmp), args.set)
    report = {"bench": "moe_balance", "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), **probe, "target": TARGET, "runs": runs,
              "verdicts": verdicts(runs, rates), "uniform_floor": uniform_floor(tokens, k, n),
              "uniform_floor_summed": uniform_floor(tokens * window, k, n, draws=20)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
