"""The planner's pipeline memory term against live bytes: what each end of a pp=2 pipeline holds for
its backward passes between actions (forward-saved tensors in flight, ZB-H1's state waiting for W,
autocast's weight copies), counted on CPU as bench/pipeline_live.py counts it (every storage the step
made and still holds, by kind: bench/live_account.py), against planner.memory.held_for_backward.
1F1B is the control (no W pending); ZB-H1's last stage holds one micro-batch in flight and one
waiting for W (the head's logit gradient included). Splits whose first stage holds the embedding alone or
whose last holds the head and the loss alone (`parallel.stage_layers` 0, 4 and 4, 0) count each end's own blocks."""

import sys
from pathlib import Path

from harness import run_ranks
from teratrain.config import load_config
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.memory import held_for_backward

BENCH = Path(__file__).resolve().parents[2] / "bench"
M = 2  # enough for both schedules to reach their fullest moment at pp = 2
HELD = ("casts", "inflight", "w_inputs", "w_grads", "head_input", "logit_grad", "head_weight_grad", "w_extra")
TOLERANCE = 0.01  # relative; what differs: token ids and targets made before the step, the norm scales' early gradients


def _sets() -> list[str]:
    sys.path.insert(0, str(BENCH))
    import pipeline_live

    return pipeline_live.SMOKE + pipeline_live.COMMON + ["parallel.pp=2"]


RUNS = {"1f1b": ("1f1b", []), "zb-h1": ("zb-h1", []),  # 64 tokens a micro-batch: the head's gradient made in I
        "zb-h1 mb1": ("zb-h1", ["train.micro_batch=1"]),  # 32 (< d V / (V + d)): its W keeps the logit gradient
        "1f1b first empty": ("1f1b", ["parallel.stage_layers=[0, 4]"]),  # the embedding alone on the first stage
        "zb-h1 last empty": ("zb-h1", ["parallel.stage_layers=[4, 0]"])}  # the head and the loss alone on the last


def live_held(rank: int, world: int) -> dict[str, float]:
    """The most bytes this rank holds for backward after any action, per run (MiB)."""
    sys.path.insert(0, str(BENCH))
    import pipeline_live

    out = {}
    for name, (schedule, extra) in RUNS.items():
        rows = pipeline_live.measure(_sets() + extra, schedule, M, by_kind=True)
        rows = rows["after_each_action_mib_peak_during_by_kind"]
        out[name] = max(sum(kinds[k] for k in HELD) for _, _, _, kinds in rows)
        out[name + " extra"] = max(kinds["w_extra"] for _, _, _, kinds in rows)
        out[name + " logits"] = max(kinds["logit_grad"] for _, _, _, kinds in rows)
    return out


def test_planner_counts_what_each_pipeline_end_holds_live():
    live = run_ranks(live_held, 2)
    for name, (schedule, extra) in RUNS.items():
        mb = 1 if "train.micro_batch=1" in extra else 2
        cfg = load_config(None, _sets() + extra + [f"parallel.schedule={schedule}", f"train.global_batch={mb * M}"])
        planned = held_for_backward(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), device="cpu")
        for rank, end in enumerate(("first", "last")):
            got, want = live[rank][name], planned[end] / 2**20
            if name == "1f1b first empty" and end == "first":  # the embedding alone keeps nothing: the planner
                ids = M * mb * cfg.model.seq_len * 8  # counts the in-flight token ids, made before the step
                assert got == 0 and planned[end] == ids, (got, planned[end])
                continue
            assert abs(got - want) <= TOLERANCE * got, (name, end, got, want)
            assert live[rank][name + " extra"] == 0  # nothing beyond what W reads waits for W
    assert live[1]["zb-h1 logits"] == 0 < live[1]["zb-h1 mb1 logits"]  # the head's W: made in I at 64 tokens only
