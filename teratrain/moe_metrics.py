"""What a mixture-of-experts run reports: per MoE layer and optimizer step, the aux loss, the share of
routed choices dropped for capacity and the expert load (tokens routed to each expert, over the
whole global batch) in metrics.jsonl; a load heatmap, `moe_load.png`, at the end of the run."""

from __future__ import annotations

from pathlib import Path

import torch

from teratrain.metrics import read_metrics
from teratrain.models.moe import EXCHANGE_STATS, moe_layers
from teratrain.parallel.comm import all_gather_objects, all_reduce


def step_metrics(model, rt) -> dict:
    """This step's MoE statistics of every MoE layer, summed over the data-parallel ranks
    (tensor-parallel peers route the same tokens; an expert-parallel rank counts the tokens it
    routes, wherever their experts live) and gathered from every pipeline stage. Collective over dp
    (and pp for an MoE model: after the step, when no stage waits on another); {} for a dense model.
    Resets the layers' counters and moves each balance=bias router's expert bias by the summed load
    (the same counts, so the same bias, on every rank). Keys: `moe` {layer: {aux_loss, dropped, load}}, `moe_aux_loss`
    (summed over layers), `moe_dropped` (over all layers), and where experts are exchanged between ranks
    `exchange_padding` per layer and `moe_exchange_padding`: the share of the rows sent that carried no token
    (a padded exchange's empty slots; 0 for the exact one)."""
    layers = moe_layers(model)
    if rt.dims.pp > 1 and model.cfg.moe.enabled:  # pipelines run teratrain's own decoder only
        parts = all_gather_objects(_stage_rows(layers, rt), rt.group("pp"))  # a stage may hold no MoE layer
        return _summary({key: row for part in parts for key, row in part.items()})
    return _summary(_stage_rows(layers, rt)) if layers else {}


def _stage_rows(layers, rt) -> dict[str, list[float]]:
    """{layer key: [load per expert..., dropped, attempted, summed aux loss, forwards, exchanged rows that
    carried a token, all exchanged rows]} of this rank's MoE layers, summed over dp (collective over dp)."""
    if not layers:
        return {}
    n = layers[0][1].num_experts
    rows = []
    for _, layer in layers:
        s = layer.pop_stats()
        zero = torch.zeros((), dtype=torch.float64, device=rt.device)
        rows.append(torch.cat([s.get("load", torch.zeros(n, dtype=torch.float64, device=rt.device)).to(rt.device),
                               torch.stack([s.get(k, zero).to(rt.device)
                                            for k in ("dropped", "attempted", "aux_loss", "forwards",
                                                      *EXCHANGE_STATS)])]))
    table = torch.stack(rows)  # (layers, n + 6)
    all_reduce(table, rt.dp_group)
    for (_, layer), row in zip(layers, table):
        layer.update_bias(row[:n])  # DeepSeek-V3's auxiliary-loss-free balancing: load over the global batch
    return {key: row for (key, _), row in zip(layers, table.tolist())}


def _summary(rows: dict[str, list[float]]) -> dict:
    if not rows:
        return {}
    out, dropped, attempted, carried, slots = {}, 0.0, 0.0, 0.0, 0.0
    for key in sorted(rows, key=int):  # global layer order
        *load, d, a, aux, forwards, full, sent = rows[key]  # exchanged rows: carrying a token, all
        out[f"layers.{key}"] = {"aux_loss": aux / max(forwards, 1), "dropped": d / a if a else 0.0,
                                "load": [int(x) for x in load]}
        if sent:
            out[f"layers.{key}"]["exchange_padding"] = 1 - full / sent
        dropped, attempted, carried, slots = dropped + d, attempted + a, carried + full, slots + sent
    exchange = {"moe_exchange_padding": 1 - carried / slots} if slots else {}
    return {"moe": out, "moe_aux_loss": sum(v["aux_loss"] for v in out.values()),
            "moe_dropped": dropped / attempted if attempted else 0.0, **exchange}


def plot_moe_load(metrics_path: Path, out: Path) -> bool:
    """moe_load.png: per MoE layer, each expert's share of the routed tokens at every step (a
    balanced router is an even colour). Returns False when the run logged no MoE statistics."""
    rows = [r for r in read_metrics(metrics_path) if r.get("moe")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(rows[-1]["moe"])
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 1.2 + 1.6 * len(keys)), squeeze=False, sharex=True)
    for ax, key in zip(axes[:, 0], keys):
        load = torch.tensor([r["moe"][key]["load"] for r in rows], dtype=torch.float64)  # (steps, n)
        share = (load / load.sum(1, keepdim=True).clamp(min=1)).t().numpy()
        n = share.shape[0]
        im = ax.imshow(share, aspect="auto", origin="lower", cmap="viridis", vmin=0,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, n - 0.5), interpolation="nearest")
        last = rows[-1]["moe"][key]
        ax.set_title(f"{key}: aux loss {last['aux_loss']:.4g}, {last['dropped']:.1%} of choices dropped "
                     f"(last step); even share = {1 / n:.3f}", fontsize=9)
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax, label="share of tokens", pad=0.01)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
