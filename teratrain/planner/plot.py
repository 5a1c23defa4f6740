"""`teratrain plan --plot FILE`: stacked bars of per-GPU memory as each ZeRO-paper saving is added
(Rajbhandari et al. 2020, Figure 1's P_os, P_os+g, P_os+g+p), then recomputation and offload.
`--schedule-plot FILE`: the chosen layout's pipeline step as the simulator predicts it."""

from __future__ import annotations

from teratrain.parallel.pipeline.schedules import config_name
from teratrain.planner import pipeline
from teratrain.planner.hardware import GPU
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.memory import GIB, plan_memory
from teratrain.planner.comm import p2p_s
from teratrain.planner.time import TimeBreakdown

KINDS = [("params", "parameters", "#4C72B0"), ("grads", "gradients", "#55A868"),
         ("optimizer", "optimizer state", "#C44E52"), ("activations", "activations", "#8172B2"),
         ("buffers", "temporary buffers", "#CCB974"), ("allowance", "context + fragmentation", "#8C8C8C")]


def variants(shape: ModelShape, base: Layout) -> list[tuple[str, Layout]]:
    """Baseline data parallelism, ZeRO-1/2/3, + full recomputation, + CPU offload, on `base`'s degrees."""
    rc = "none" if shape.is_bare else "full"
    plain = base.with_(recompute="none", offload="none")
    out = [("baseline DP", plain.with_(zero=0)), ("ZeRO-1", plain.with_(zero=1)), ("ZeRO-2", plain.with_(zero=2)),
           ("ZeRO-3", plain.with_(zero=3))]
    if not shape.is_bare:
        out.append(("ZeRO-3\n+ recompute", plain.with_(zero=3, recompute=rc)))
    out.append(("ZeRO-3\n+ recompute\n+ offload" if not shape.is_bare else "ZeRO-3\n+ offload",
                plain.with_(zero=3, recompute=rc, offload="params")))
    return out


def what_if_base(base: Layout, global_batch: int, dp: int = 8) -> Layout:
    """With one data-parallel rank ZeRO has nothing to shard: chart the same micro-batch at dp=8."""
    if base.dp > 1:
        return base
    mb = min(base.micro_batch, max(1, global_batch // dp))
    return base.with_(dp=dp, micro_batch=mb, num_microbatches=max(1, global_batch // (dp * mb)))


def plot_memory(path: str, shape: ModelShape, train: Training, base: Layout, gpu: GPU, gpu_mem_gib: float,
                title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(label, plan_memory(shape, train, lay, gpu)) for label, lay in variants(shape, base)]
    fig, ax = plt.subplots(figsize=(9, 5))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for key, label, color in KINDS:
        vals = [_shown(m, key) / GIB for _, m in bars]
        ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, (_, m) in zip(xs, bars):
        note = f"{m.total / GIB:.1f}"
        if m.host:
            note += f"\n(+{m.host / GIB:.1f} host)"
        ax.text(x, bottom[x] * 1.01, note, ha="center", va="bottom", fontsize=8)
    ax.axhline(gpu_mem_gib, color="black", ls="--", lw=1)
    ax.text(-0.45, gpu_mem_gib, f"GPU memory {gpu_mem_gib:g} GiB", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("GiB per GPU (at the peak)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(max(bottom), gpu_mem_gib) * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shown(m, key: str) -> float:
    """Bytes of one kind alive at the peak moment (the allowance sits on top)."""
    if key == "allowance":
        return m.allowance
    return m.at_peak.get(key, 0)


def plot_schedule(path: str, shape: ModelShape, train: Training, lay: Layout, t: TimeBreakdown, gpu: GPU,
                  **options) -> str:
    """Draw `lay`'s pipeline step, simulated with the planner's compute time per micro-batch and stage (each
    stage by its blocks, the head on the last) and its activation transfer time; return the note for the
    report. `options` go to the schedule."""
    from teratrain.parallel.pipeline.plot import plot_timeline

    if lay.pp == 1:
        return "no pipeline timeline drawn: the chosen layout has pp=1; fix one with --set parallel.pp=N"
    name = config_name(lay.schedule)
    head_s = t.terms.get("head_s", 0.0)  # the head and the loss, on the last stage (time.py spread the loss)
    rank_s = t.compute_s + t.ops_s + (t.terms.get("loss_s", 0.0) - head_s) / lay.pp
    tl = pipeline.timeline(lay, rank_s, p2p_s(shape, train, lay, gpu), head_s, pipeline.stage_split(shape, lay),
                           **options)
    chunks = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    title = (f"{shape.name}: {name}, pp={lay.pp}{chunks}, {lay.num_microbatches} micro-batches of "
             f"{lay.micro_batch}; simulated step {tl.makespan_s * 1e3:,.0f} ms")
    plot_timeline(path, tl.intervals, num_ranks=lay.pp, title=title, unit="ms", scale=1e3)
    return f"pipeline timeline written to {path} ({name}, simulated bubble {tl.bubble_fraction:.1%})"
