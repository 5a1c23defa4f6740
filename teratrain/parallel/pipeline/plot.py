"""Per-rank pipeline timelines as a picture: the simulator's prediction, and beside it a measured one.

One row per rank, time to the right. Colour = micro-batch; the kind of work is the fill: forward
solid, backward (B) and input-gradient (I) hatched, weight-gradient (W) dotted, optimizer STEP
black; idle time is the grey background. Boxes wide enough carry their label (`F3`, `B3`; `F3.1`
for chunk 1 of an interleaved rank; `F3 v1` when the action names weight version 1). Measured
intervals use the simulator's `Interval` record, so `plot_timeline(path, predicted, measured)` draws
both on one figure, one panel above the other (each on its own time axis).
"""

from __future__ import annotations

from typing import Sequence

from teratrain.parallel.pipeline.simulate import Interval, bubble_fraction

HATCH = {"F": "", "B": "///", "I": "\\\\\\", "W": "...", "STEP": ""}
NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad", "STEP": "optimizer step"}


def _colour(mb: int, chunk: int, num_microbatches: int):
    import matplotlib

    if num_microbatches <= 10:
        base = matplotlib.colormaps["tab10"](mb)
    else:  # many micro-batches: hues in order, so one can follow a micro-batch through the pipe
        base = matplotlib.colormaps["turbo"](0.05 + 0.9 * mb / (num_microbatches - 1))
    lift = min(0.45, 0.3 * chunk)  # later chunks of an interleaved rank: the same hue, lighter
    return tuple(c + (1 - c) * lift for c in base[:3])


def _draw(ax, intervals: Sequence[Interval], num_ranks: int, title: str, unit: str, scale: float,
          width_in: float) -> None:
    end = max((iv.end for iv in intervals), default=1.0)
    start = min((iv.start for iv in intervals), default=0.0)
    span = max(end - start, 1e-12)
    chunks = max((iv.chunk for iv in intervals), default=0) > 0
    num_mb = 1 + max((iv.microbatch for iv in intervals), default=0)
    groups: dict[tuple[int, str], tuple[list, list]] = {}  # one bar collection per (rank, kind): fast to draw
    for iv in intervals:
        x, w = (iv.start - start) * scale, (iv.end - iv.start) * scale
        boxes, colours = groups.setdefault((iv.rank, iv.kind), ([], []))
        boxes.append((x, max(w, span * scale * 0.002) if iv.kind == "STEP" else w))
        colours.append("black" if iv.kind == "STEP" else _colour(iv.microbatch, iv.chunk, num_mb))
        inches = w / (span * scale) * width_in * 0.9
        label = f"{iv.kind}{iv.microbatch}" + (f".{iv.chunk}" if chunks else "")
        label += f" v{iv.version}" if iv.version is not None and inches > 0.065 * (len(label) + 3) else ""
        if inches > 0.065 * len(label) and iv.kind != "STEP":  # room for the label at 7 pt
            ax.text(x + w / 2, iv.rank, label, ha="center", va="center", fontsize=7, zorder=4,
                    bbox=None if iv.kind == "F" else dict(boxstyle="square,pad=0.05", fc="white", ec="none", alpha=0.6))
    for r in range(num_ranks):
        ax.broken_barh([(0, span * scale)], (r - 0.42, 0.84), color="#e6e6e6", zorder=0)
    for (r, kind), (boxes, colours) in groups.items():
        ax.broken_barh(boxes, (r - 0.42, 0.84), facecolors=colours, edgecolor="white", linewidth=0.6,
                       hatch=HATCH.get(kind, ""), zorder=3 if kind == "STEP" else 2)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(f"time ({unit})")
    bubble = bubble_fraction(intervals, num_ranks)
    ax.set_title(f"{title}   (bubble {bubble:.1%})", fontsize=10, loc="left")


def _width_for_labels(intervals: Sequence[Interval]) -> float:
    """Inches at which the shortest box is 0.3 inch wide (room for its label)."""
    boxes = [iv.end - iv.start for iv in intervals if iv.kind != "STEP"]
    if not boxes:
        return 0.0
    span = max(iv.end for iv in intervals) - min(iv.start for iv in intervals)
    return 0.3 / 0.9 * span / max(min(boxes), span * 1e-3)


def plot_timeline(path: str, predicted: Sequence[Interval], measured: Sequence[Interval] | None = None, *,
                  num_ranks: int | None = None, title: str = "pipeline schedule", unit: str = "s",
                  scale: float = 1.0) -> None:
    """Write a PNG: the predicted timeline, and the measured one under it when given. `scale`
    multiplies times for display (e.g. 1e3 with unit="ms")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("predicted (simulator)" if measured is not None else title, predicted)]
    if measured is not None:
        panels.append(("measured", measured))
    n = num_ranks or 1 + max(iv.rank for _, ivs in panels for iv in ivs)
    width = min(18.0, max(13.0, *(_width_for_labels(ivs) for _, ivs in panels)))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 0.6 * n * len(panels) + 1.6 * len(panels) + 0.4),
                             squeeze=False)
    for ax, (name, ivs) in zip(axes[:, 0], panels):
        _draw(ax, ivs, n, name, unit, scale, width)
    kinds = [k for k in HATCH if any(iv.kind == k for _, ivs in panels for iv in ivs)]
    handles = [Patch(facecolor="white" if k != "STEP" else "black", edgecolor="#444", hatch=HATCH[k],
                     label=NAMES[k]) for k in kinds] + [Patch(facecolor="#e6e6e6", label="idle")]
    if any(iv.chunk for _, ivs in panels for iv in ivs):
        handles.append(Patch(facecolor="#b0b0b0", label="lighter: later model chunk"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    if measured is not None:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    num_mb = 1 + max((iv.microbatch for _, ivs in panels for iv in ivs), default=0)
    if num_mb > 10:  # too many for labels: a colour scale says which micro-batch a box is
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        bar = fig.colorbar(ScalarMappable(Normalize(0, num_mb - 1), matplotlib.colormaps["turbo"]), ax=axes[:, 0],
                           fraction=0.015, pad=0.01)
        bar.set_label("micro-batch", fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
