"""The layouts `bench/planner_validate.py --gpus N` measures, sized to the GPU found, and the
candidates `--check-pick` measures.

Each row is one layout of one model: name, the --set items beyond the model's, and whether it is
held out (never used to fit a constant: teratrain/planner/refit.py fits on the other rows only).
The dense model is llama-1b's width (d 2048, 32 heads, 8 KV heads, d_ff 8192) with a 32k vocabulary
and 2048-token sequences, bf16 autocast; the MoE model has the same attention, 4 experts of d_ff 4096
and top-2 routing in every block, half the layers. `size_layers` picks the most layers (of 32, 24,
16, 8) for which the planner puts every row below 70% of the GPU's memory and the rows' steps within
the time budget: the planner sizes its own test, and the 30% margin covers an error far beyond the
1% it showed on one GPU (an out-of-memory rank would stall the shared processes).
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_CHOICES = (32, 24, 16, 8)  # multiples of pp x virtual_stages (up to 4 x 2)
COMMON = ["train.compile=false", "train.eval_batches=0", "metrics.progress=false", "optim.warmup_steps=0"]
MEMORY_SHARE = 0.70
BUILD_S = 4.0  # materializing and initializing a row's model, creating its engine (seconds, measured ~2-3)


@dataclass(frozen=True)
class Row:
    name: str
    sets: tuple[str, ...]
    held_out: bool = False
    moe: bool = False


def dense(layers: int, smoke: bool = False) -> list[str]:
    if smoke:
        return [f"model.n_layers={layers}", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=128",
                "model.seq_len=32", "model.vocab_size=512", "memory.precision=fp32", "train.device=cpu"]
    return ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048", f"model.n_layers={layers}",
            "memory.precision=bf16"]


def moe(layers: int, smoke: bool = False) -> list[str]:
    experts = ["model.moe.num_experts=4", "model.moe.top_k=2"]
    if smoke:
        return dense(layers, True) + experts + ["model.d_ff=64"]
    return dense(max(4, layers // 2)) + experts + ["model.d_ff=4096"]


def pipeline_sets(schedule: str, pp: int, m: int, mb: int = 2, dp: int = 1, extra: tuple = ()) -> tuple[str, ...]:
    v = 2 if schedule == "interleaved-1f1b" else 1
    return (f"parallel.pp={pp}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
            f"train.global_batch={dp * m * mb}", f"train.micro_batch={mb}", *extra)


def _dp(gb: int, mb: int, *extra: str) -> tuple[str, ...]:
    return (f"train.global_batch={gb}", f"train.micro_batch={mb}", *extra)


def _zero_rows(dp: int) -> list[Row]:
    """Data parallelism at degree `dp` in every ZeRO stage (2 micro-batches of 2 per rank), the
    recomputing ZeRO-3 at micro-batch 4 and the optimizer offload at one micro-batch per rank."""
    gb = 4 * dp
    return [
        *(Row(f"dp{dp} zero{z}", _dp(gb, 2, f"parallel.zero={z}")) for z in range(4)),
        Row(f"dp{dp} zero3 mb4 full", _dp(gb, 4, "parallel.zero=3", "memory.recompute=full"), True),
        Row(f"dp{dp} zero2 offload", _dp(gb // 2, 2, "parallel.zero=2", "parallel.offload=optimizer"), True),
    ]


def _sweep(schedule: str, pp: int, ms: tuple[int, ...]) -> list[Row]:
    """One schedule at each micro-batch count of `ms`; the largest is held out (refit.py never fits on it)."""
    label = "interleaved v2" if schedule == "interleaved-1f1b" else schedule
    return [Row(f"pp{pp} {label} m{m}", pipeline_sets(schedule, pp, m), m == ms[-1]) for m in ms]


def rows_2() -> list[Row]:
    """Every form of each parallelism 2 GPUs hold, and what composes on 2."""
    tp = ("parallel.tp=2",)
    return [
        *_zero_rows(2),
        Row("tp2 megatron+sp", _dp(4, 2, *tp)),
        Row("tp2 megatron", _dp(4, 2, *tp, "parallel.sequence_parallel=false")),
        Row("tp2 all-gather", _dp(4, 2, *tp, "parallel.tp_form=all-gather")),
        Row("tp2 all-reduce", _dp(4, 2, *tp, "parallel.tp_form=all-reduce"), True),
        Row("tp2 sp mb4 selective", _dp(8, 4, *tp, "memory.recompute=selective"), True),
        *_sweep("gpipe", 2, (2, 4, 8)),
        *_sweep("1f1b", 2, (2, 4, 8)),
        *_sweep("interleaved-1f1b", 2, (4, 8)),
        *_sweep("zb-h1", 2, (4, 8)),
        Row("pp2 1f1b m4 full", pipeline_sets("1f1b", 2, 4, extra=("memory.recompute=full",)), True),
        Row("pp2 pipedream-2bw m4", pipeline_sets("pipedream-2bw", 2, 4), True),
        Row("moe dp2 ep1", _dp(4, 2, "parallel.ep=1"), moe=True),
        Row("moe dp2 ep2", _dp(4, 2, "parallel.ep=2"), moe=True),
        Row("moe dp2 ep2 zero1", _dp(4, 2, "parallel.ep=2", "parallel.zero=1"), True, moe=True),
        Row("moe tp2", _dp(4, 2, *tp), True, moe=True),
    ]


def rows_4() -> list[Row]:
    """The 2-GPU forms at 4, and their compositions: tp x dp, pp x dp, pp x tp, ep x dp, ep x tp x dp."""
    tp2, tp4 = ("parallel.tp=2",), ("parallel.tp=4",)
    return [
        *_zero_rows(4),
        Row("tp4 megatron+sp", _dp(4, 2, *tp4)),
        Row("tp4 megatron", _dp(4, 2, *tp4, "parallel.sequence_parallel=false"), True),
        Row("tp4 all-gather", _dp(4, 2, *tp4, "parallel.tp_form=all-gather"), True),
        Row("tp2 dp2 zero1", _dp(8, 2, *tp2, "parallel.zero=1")),
        Row("tp2 dp2 zero3", _dp(8, 2, *tp2, "parallel.zero=3"), True),
        *_sweep("1f1b", 4, (4, 8, 16)),
        *_sweep("gpipe", 4, (4, 8)),
        *_sweep("interleaved-1f1b", 4, (8, 16)),
        Row("pp4 zb-h1 m8", pipeline_sets("zb-h1", 4, 8)),
        Row("pp4 pipedream-2bw m8", pipeline_sets("pipedream-2bw", 4, 8), True),
        Row("pp2 dp2 1f1b m4 zero1", pipeline_sets("1f1b", 2, 4, dp=2, extra=("parallel.zero=1",))),
        Row("pp2 tp2 1f1b m4", pipeline_sets("1f1b", 2, 4, extra=tp2)),
        Row("pp2 dp2 interleaved v2 m4", pipeline_sets("interleaved-1f1b", 2, 4, dp=2), True),
        Row("pp2 tp2 zb-h1 m8", pipeline_sets("zb-h1", 2, 8, extra=tp2), True),
        Row("moe dp4 ep2", _dp(8, 2, "parallel.ep=2"), moe=True),
        Row("moe dp4 ep4", _dp(8, 2, "parallel.ep=4"), moe=True),
        Row("moe dp4 ep4 zero1", _dp(8, 2, "parallel.ep=4", "parallel.zero=1"), True, moe=True),
        Row("moe tp2 dp2 ep2", _dp(8, 2, *tp2, "parallel.ep=2"), True, moe=True),
    ]


SMOKE = ("dp2 zero1", "dp2 zero3", "tp2 megatron+sp", "tp2 megatron", "tp2 all-gather", "tp2 all-reduce",
         "pp2 1f1b m4", "pp2 interleaved v2 m4", "moe dp2 ep2",
         # at 4: each composition's code path once
         "dp4 zero3", "tp4 megatron+sp", "tp2 dp2 zero1", "pp4 1f1b m4", "pp4 interleaved v2 m8", "pp4 zb-h1 m8",
         "pp2 dp2 1f1b m4 zero1", "pp2 tp2 1f1b m4", "moe dp4 ep4", "moe tp2 dp2 ep2")


def rows_for(gpus: int, smoke: bool = False) -> list[Row]:
    if gpus not in (2, 4):
        raise SystemExit(f"--gpus {gpus}: the validation layouts are written for 2 and 4 GPUs")
    rows = rows_2() if gpus == 2 else rows_4()
    return [r for r in rows if r.name in SMOKE] if smoke else rows


# The host probe (planner_multi.py, before the rows): the dense model's structure at a width where every
# kernel takes a few microseconds, so a step's time is the host's time to issue it. One layout without
# tensor parallelism gives the host's cost per eager op, the tp layouts (plain and sequence-parallel,
# whose collectives differ in number) its cost per tp collective, and ZeRO-3 (the same ops, a launch per
# flat group, pass and micro-batch) its cost per data-parallel engine launch on this machine
# (teratrain/planner/refit.py `fit_host`).
PROBE_LAYERS = 4
PROBE_STEPS, PROBE_WARMUP = 10, 3


# the probe's model but its depth: every kernel takes microseconds, so the host paces any layout of it
PROBE_WIDTH = ("model.d_model=256", "model.n_heads=16", "model.n_kv_heads=4", "model.d_ff=512", "model.seq_len=128",
               "model.vocab_size=1024")


def probe_rows(gpus: int, smoke: bool = False) -> list[dict]:
    """The host probe's rows: names and --set items."""
    model = ["model.preset=llama-1b", f"model.n_layers={PROBE_LAYERS}", *PROBE_WIDTH]
    model += ["memory.precision=fp32", "train.device=cpu"] if smoke else ["memory.precision=bf16"]
    tp = f"parallel.tp={gpus}"
    # (global batch, layout): 2 micro-batches of one sequence on every rank
    layouts = {"probe dp": (2 * gpus, (f"parallel.dp={gpus}",)),
               f"probe tp{gpus}": (2, (tp, "parallel.sequence_parallel=false")),
               f"probe tp{gpus} sp": (2, (tp, "parallel.sequence_parallel=true")),
               # the data-parallel engines' launches: ZeRO-3 gathers every group before its forward and
               # its backward and reduces it, each micro-batch (planner/time.py engine_launches)
               "probe dp zero3": (2 * gpus, (f"parallel.dp={gpus}", "parallel.zero=3"))}
    return [{"name": name, "sets": COMMON + model + list(_dp(batch, 1, *lay)), "est_s": 0.0}
            for name, (batch, lay) in layouts.items()]


def full_sets(row: Row, layers: int, smoke: bool) -> list[str]:
    """Every --set item of a row: common settings, its model, its layout."""
    return COMMON + (moe(layers, smoke) if row.moe else dense(layers, smoke)) + list(row.sets)


def predict(sets: list[str], gpus: int, gpu, device: str = "cuda"):
    """The planner's Candidate for a row's config (hardware `gpu`)."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.search import evaluate

    cfg = load_config(None, sets)
    return evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, gpus), gpu, device=device)


def host_paced(cand) -> bool:
    """Whether the planner expects the host to pace a row (its host time at least 0.8 of its GPU
    time): the host CPU's speed shifts for seconds at a time on cloud machines, so planner_multi.py
    measures such a row a second time and keeps the faster visit."""
    return cand.time.terms["host_s"] >= 0.8 * cand.time.terms["gpu_s"]


def size_layers(rows: list[Row], gpus: int, gpu, budget_s: float, steps: int) -> tuple[int, list[dict]]:
    """The most layers for which every row fits MEMORY_SHARE of the GPU and all rows' steps and
    builds fit `budget_s` (module docstring); with the planner's estimate for each row and whether
    it expects the host to pace it (`host_paced`)."""
    for layers in LAYER_CHOICES:
        cands = [predict(full_sets(r, layers, False), gpus, gpu) for r in rows]
        need = sum(steps * c.time.step_time_s + BUILD_S for c in cands)
        if all(c.memory.total <= MEMORY_SHARE * gpu.memory_gib * 2**30 for c in cands) and need <= budget_s:
            return layers, [{"name": r.name, "est_s": steps * c.time.step_time_s + BUILD_S, "revisit": host_paced(c)}
                            for r, c in zip(rows, cands)]
    raise SystemExit(f"no model of {LAYER_CHOICES[-1]} layers or more fits the budget of {budget_s:g} s on this "
                     "GPU; give a larger --budget-s")
