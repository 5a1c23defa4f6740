"""The planner against published large training runs (bench/published_runs.toml): each run's layout
planned as the paper ran it, its step time against the paper's, whether the planner says it fits, and the
planner's own pick for the run (its search over FREE: about ten minutes for all runs on two cores).

    python bench/published.py                  # the table, to stdout
    python bench/published.py --write-docs     # the same table into docs/published_runs.md, between its markers
    python bench/published.py --plot docs/published_runs.png    # each run's ratio, drawn (seconds)

A paper that states achieved TFLOP/s per GPU is turned into a step time with the paper's own FLOP count
(`flops` of a run): the time that FLOP rate takes for one global batch on its GPUs; one that states tokens
per second per GPU, into the time that rate takes for the global batch's tokens. The ratio is
predicted / published step time: over 1 the planner is slower than the paper. Each run is planned at the GEMM
efficiency its card's published runs reached (planner/calibration/published.toml: the software that ran them,
not teratrain's own, which calibration/<card>.toml holds). Runs with split = "fit" calibrated it
(bench/calibrate/published_fit.py); the others never informed a constant.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench" / "published_runs.toml"
DOCS = ROOT / "docs" / "published_runs.md"
BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"
CARD = {"a100": "A100 80GB", "h100": "H100 80GB"}


def load_runs(path: Path = RUNS) -> list[dict]:
    return tomllib.loads(path.read_text())["run"]


def paper_flops(run: dict) -> float:
    """FLOPs of one global batch as the paper counts them (`flops` of the run)."""
    b, s, l, h, v = run["global_batch"], run["seq_len"], run["n_layers"], run["d_model"], run["vocab_size"]
    if run["flops"] == "narayanan21":  # 96 B s l h^2 (1 + s/6h + V/16lh): the recomputed forward included
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if run["flops"] == "dense6n":  # 6 N per token (N the matmul weights), attention's 12 l h s per token
        kv = h // run["n_heads"] * run.get("n_kv_heads", run["n_heads"])
        n = l * (2 * h * h + 2 * h * kv + 3 * h * run["d_ff"]) + h * v
        return b * s * (6 * n + 12 * l * h * s)
    raise ValueError(f"run {run['name']}: flops = {run['flops']!r} is unknown; use \"narayanan21\" or \"dense6n\".")


# the figure types a run may state, with the unit the table prints
FIGURE_UNIT = {"step_s": "s", "tflops_per_gpu": "TFLOP/s", "tokens_per_s_per_gpu": "tokens/s/GPU"}


def published_step_s(run: dict) -> float:
    """The published figure as seconds per global batch (a tokens-per-second figure: the time the run's
    GPUs take for its global batch of sequences at that rate)."""
    if run["figure"] not in FIGURE_UNIT:
        raise ValueError(f"run {run['name']}: figure = {run['figure']!r} is unknown; use one of {sorted(FIGURE_UNIT)}.")
    if run["figure"] == "step_s":
        return float(run["value"])
    if run["figure"] == "tokens_per_s_per_gpu":
        return run["global_batch"] * run["seq_len"] / (run["gpus"] * run["value"])
    return paper_flops(run) / (run["gpus"] * run["value"] * 1e12)


def sets_of(run: dict) -> list[str]:
    """The --set items of a run's model and layout."""
    keys = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len")
    sets = [f"model.{k}={run[k]}" for k in keys if k in run]
    if "n_kv_heads" not in run:  # multi-head attention, not the preset's grouped key/value heads
        sets.append(f"model.n_kv_heads={run['n_heads']}")
    sets += [f"parallel.{k}={run[k]}" for k in ("tp", "pp", "dp", "cp", "virtual_stages")]
    if run["virtual_stages"] > 1:
        sets.append("parallel.schedule=interleaved-1f1b")
    if "stage_layers" in run:  # the blocks of each pipeline stage, where the run split them unevenly
        sets.append(f"parallel.stage_layers=[{','.join(map(str, run['stage_layers']))}]")
    sets += [f"parallel.sequence_parallel={str(run['sequence_parallel']).lower()}",
             f"train.micro_batch={run['micro_batch']}", f"train.global_batch={run['global_batch']}",
             f"memory.recompute={run['recompute']}", f"memory.precision={run['precision']}"]
    # as Megatron-LM trains: 16-bit weights with fp32 master copies in the optimizer, no optimizer sharding
    # or offload, and GPT's output layer tied to its embedding
    sets += ["memory.master_weights=true", f"parallel.zero={run.get('zero', 0)}", "parallel.offload=none",
             f"parallel.overlap_comm={str(run.get('overlap_comm', True)).lower()}",
             f"parallel.reduce_dtype={run.get('reduce_dtype', 'fp32')}",
             f"model.tie_embeddings={str(run['arch'] == 'gpt2').lower()}"]
    if run.get("fused_loss"):  # a loss that keeps no fp32 copy of the logits: teratrain's chunked head and loss
        sets.append("memory.loss_chunks=0")
    return sets


def software_efficiency(gpu: str) -> dict[str, float]:
    """flops_max and flops_d_half of the software that ran the card's published runs
    (planner/calibration/published.toml, fitted by bench/calibrate/published_fit.py); {} where none is fitted."""
    from teratrain.planner.hardware import calibrated

    prefix = f"{gpu}_"
    return {key[len(prefix):]: value for key, value in calibrated("published").items() if key.startswith(prefix)}


def card(run: dict):
    """The run's GPU: its card's preset at the published software's GEMM efficiency (`software_efficiency`),
    with the machine's own terms where the paper states them (`hw`, e.g. a slower network between nodes)."""
    from teratrain.planner.hardware import gpu_with

    return gpu_with(run["gpu"], {**software_efficiency(run["gpu"]), **run.get("hw", {})})


def plan(run: dict, gpu=None):
    """The planner's Candidate for a run's layout on its card (`gpu`: another GPU object, e.g. a fit's)."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.search import evaluate

    cfg = load_config(None, sets_of(run))
    return evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, run["gpus"]), gpu or card(run))


# What the planner's pick of a run chooses (the rest of the run is kept: its model, GPUs, global batch,
# card, precision and engines, its tensor- and context-parallel degrees, no offload). tp stays the run's
# (a node's worth or less in every run) to keep the search of thousands of GPUs to minutes.
FREE = ("parallel.pp", "parallel.dp", "parallel.virtual_stages", "parallel.schedule", "parallel.stage_layers",
        "parallel.zero", "parallel.sequence_parallel", "train.micro_batch", "memory.recompute")


def pick(run: dict):
    """The planner's fastest fitting Candidate for the run with the FREE choices left to its search."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import fixed_of, shape_of, training_of
    from teratrain.planner.search import search

    cfg = load_config(None, [s for s in sets_of(run) if s.split("=")[0] not in FREE])
    return search(shape_of(cfg), training_of(cfg), run["gpus"], card(run), fixed_of(cfg))[0]


def rows(runs: list[dict] | None = None, picks: bool = True) -> list[dict]:
    """Per run: the published and predicted step, their ratio, whether it fits, and with `picks` the
    planner's pick (`pick`); `error` (and no prediction) where the planner refuses the layout (PlanError:
    e.g. layers that do not split evenly)."""
    from teratrain.planner.states import PlanError

    out = []
    for run in runs or load_runs():
        row = {"name": run["name"], "run": run, "published_s": published_step_s(run)}
        try:
            cand = plan(run)
        except PlanError as e:
            out.append({**row, "predicted_s": None, "ratio": None, "fits": None, "error": str(e)})
            continue
        out.append({**row, "predicted_s": cand.time.step_time_s, "ratio": cand.time.step_time_s / row["published_s"],
                    "fits": cand.fits, "peak_gib": cand.memory.total / 2**30, **({"pick": pick(run)} if picks else {})})
    return out


RECOMPUTE = {"full": "full rc", "selective": "sel. rc", "none": "no rc"}


def _layout(run: dict) -> str:
    return _describe(run["tp"], run["pp"], run["dp"], run["cp"], run["virtual_stages"], run["micro_batch"],
                     run["recompute"], run["sequence_parallel"], run.get("zero", 0), run["global_batch"])


def _describe(tp, pp, dp, cp, v, mb, recompute, sp, zero, batch=None) -> str:
    """A layout in a few words: t2 p4 d8 [cp2] [v2] mb1 [B512] full rc [SP] [ZeRO-1]."""
    parts = [f"t{tp} p{pp} d{dp}"] + ([f"cp{cp}"] if cp > 1 else []) + ([f"v{v}"] if v > 1 else [])
    parts += [f"mb{mb}"] + ([f"B{batch}"] if batch else []) + [RECOMPUTE.get(recompute, f"{recompute} rc")]
    return " ".join(parts + (["SP"] if sp else []) + ([f"ZeRO-{zero}"] if zero else []))


def _pick_cells(r: dict) -> str:
    """The pick's layout and predicted step, or "-" where not computed (rows(picks=False))."""
    if "pick" not in r:
        return "- | -"
    lay = r["pick"].layout
    words = _describe(lay.tp, lay.pp, lay.dp, lay.cp, lay.virtual_stages, lay.micro_batch, lay.recompute,
                      lay.sequence_parallel, lay.zero)
    return f"{words} | {r['pick'].time.step_time_s:.2f}"


def _figure(run: dict) -> str:
    return f"{run['value']:g} {FIGURE_UNIT[run['figure']]}"


def table(result: list[dict]) -> str:
    lines = ["| run | paper | GPUs | layout | published | published s | predicted s | ratio | split | fits "
             "| planner's pick | pick s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result:
        run = r["run"]
        mark = "*" if run.get("uncertain") else ""
        if r["predicted_s"] is None:
            predicted, ratio, fits = "not planned", "-", r["error"].rstrip(".")
        else:
            predicted, ratio, fits = f"{r['predicted_s']:.2f}", f"{r['ratio']:.2f}", "yes" if r["fits"] else "no"
        lines.append(f"| {r['name']}{mark} | {run['paper']}, {run['table']} | {run['gpus']} x {CARD[run['gpu']]} "
                     f"| {_layout(run)} | {_figure(run)} | {r['published_s']:.2f} | {predicted} | {ratio} "
                     f"| {run['split'].replace('_', '-')} | {fits} | {_pick_cells(r)} |")
    return "\n".join(lines)


def plot(result: list[dict], path: str) -> None:
    """Each run's predicted / published step time, by paper, against the band of 10%: filled where the run
    calibrated its card's efficiency (split = "fit"), hollow where held out, a triangle where its layout plans as
    not fitting its card."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = [r for r in result if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.axhspan(0.9, 1.1, color="0.92", zorder=0)
    ax.axhline(1.0, color="0.6", lw=0.8, zorder=1)
    colors = {"a100": "tab:blue", "h100": "tab:orange"}
    for i, r in enumerate(planned):
        run = r["run"]
        color = colors[run["gpu"]]
        ax.scatter(i, r["ratio"], s=42, marker="o" if r["fits"] else "^", zorder=3, edgecolors=color, linewidths=1.4,
                   facecolors=color if run["split"] == "fit" else "white")
    papers = [r["run"]["paper"] for r in planned]
    starts = [i for i in range(len(papers)) if i == 0 or papers[i] != papers[i - 1]]  # each paper's first run
    for i in starts[1:]:
        ax.axvline(i - 0.5, color="0.8", lw=0.6, zorder=1)
    ax.set_xticks(range(len(planned)), [r["name"].split("-", 1)[1] for r in planned], rotation=60, ha="right",
                  fontsize=7)
    ax.set_xlim(-0.7, len(planned) - 0.3)
    ax.set_ylabel("predicted / published step")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=f"{g.upper()}") for g, c in colors.items()]
    handles += [plt.Line2D([], [], ls="", marker="o", mfc="0.4", mec="0.4", label="fit"),
                plt.Line2D([], [], ls="", marker="o", mfc="white", mec="0.4", label="held out"),
                plt.Line2D([], [], ls="", marker="^", mfc="white", mec="0.4", label="plans as not fitting")]
    ax.legend(handles=handles + [plt.Rectangle((0, 0), 1, 1, color="0.92", label="within 10%")], fontsize=7,
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=6, frameon=False)
    for j, (i, end) in enumerate(zip(starts, starts[1:] + [len(papers)])):  # each paper under its runs, alternately
        ax.text((i + end - 1) / 2, 0.02 + 0.05 * (j % 2), papers[i].split(" 20")[0].replace(" et al.", ""),
                transform=ax.get_xaxis_transform(), ha="center", fontsize=7, color="0.35")
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, 0.72), max(high, 1.12))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_docs(text: str, path: Path = DOCS) -> None:
    doc = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(doc):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers; add them where the table goes.")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table in {DOCS.relative_to(ROOT)}")
    ap.add_argument("--plot", metavar="PNG", help="draw each run's predicted / published step (no picks: seconds)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(rows(picks=False), args.plot)
        print(f"wrote {args.plot}")
        return
    text = table(rows())
    if args.write_docs:
        write_docs(text)
    print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
