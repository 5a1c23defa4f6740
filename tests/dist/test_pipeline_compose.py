"""Pipeline parallelism composed with ZeRO-3, mixture of experts with
expert parallelism, activation compression and `train.compile`, each against one process on the same
global batch (the same config without its parallel.* keys: compression and compile are the math, and
the reference runs them too), fp32, 2 steps of 4 micro-batches per pipeline (2 with dp=2).

- ZeRO-3 (parallel/zero.py, "under a pipeline"): every flush schedule family, the tied embedding
  sharded over both end stages (its gather first thing in the step), recomputation (a recomputed
  block gathered again after its gradients were reduced), offloaded parameters, dp=2.
- MoE: every stage's aux losses enter its own backward and the reported loss; a stage without MoE
  layers (model.moe.every=2 on 2 layers), capacity drops, ZB-H1's split backward, ep=2 inside a
  stage with ZeRO-1/3; the trainer's MoE statistics of every layer, whatever stage holds it; the
  expert bias of balance=bias moved by each stage for its own layers.
- Compression: int8 under interleaved 1F1B with ZeRO-3; the stage input encoded as one process
  encodes that activation (bitwise equal to one process with the same compression).
- compile: per block, marked `long` (inductor compiles each block on CPU: ~90 s cold on 2 cores).

Tolerance: 1e-5 relative on every step's loss and every final parameter (gathered whole). Measured:
pipelining with ZeRO-3, MoE or compression alone is bitwise; dp, ep and compile add up to ~2e-6.
Routers are deterministic here (top-1, top-k): `train_random`'s routing seeds hook the model's forward,
which a pipeline stage never runs."""

import pytest

from layout_workers import train_random
from test_pipeline_parity import GPT2_SGD, STEPS, _compare as compare
from test_tensor_parallel import TOL

INTERLEAVED = ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=4"]
MOE = ["model.moe.num_experts=4", "optim.weight_decay=0.0"]
TOP1 = MOE + ["model.moe.router=switch-top1", "model.moe.capacity_factor=1.0"]  # every layer, drops
TOP2_HALF = MOE + ["model.moe.router=softmax-topk", "model.moe.capacity_factor=1.0", "model.moe.every=2"]


def _compare(layouts: list[list[str]], world: int) -> None:
    compare(layouts, world, _same_moe_statistics)


def _same_moe_statistics(layout, got: dict, ref: dict) -> None:
    assert got["moe"]["dropped"] == ref["moe"]["dropped"], f"{layout}: capacity drops differ"
    mine, theirs = got["moe_metrics"].get("moe", {}), ref["moe_metrics"].get("moe", {})
    assert mine.keys() == theirs.keys(), f"{layout}: MoE statistics of layers {list(mine)}, not {list(theirs)}"
    for key, row in theirs.items():
        assert mine[key]["load"] == row["load"] and mine[key]["dropped"] == row["dropped"], f"{layout}: {key}"
        assert abs(mine[key]["aux_loss"] - row["aux_loss"]) <= TOL * abs(row["aux_loss"]), f"{layout}: {key} aux"


def test_pp2_with_zero3_moe_and_compression():
    _compare([["parallel.pp=2", "parallel.zero=3"],
              GPT2_SGD + ["parallel.pp=2", "parallel.zero=3", "parallel.schedule=zb-h1", "memory.recompute=full"],
              ["parallel.pp=2", "parallel.zero=3", "memory.compress_activations=int8", *INTERLEAVED],
              TOP1 + ["parallel.pp=2"],
              TOP2_HALF + ["parallel.pp=2", "parallel.schedule=zb-h1"]], world=2)


def test_pp2_with_dp2_zero3_and_ep2():
    _compare([["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.schedule=gpipe"],
              GPT2_SGD + ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", *INTERLEAVED],
              ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.schedule=zb-h1", "model.n_layers=4",
               "memory.recompute=every-k", "parallel.offload=params"],
              TOP2_HALF + ["parallel.pp=2", "parallel.ep=2", "parallel.zero=1"],
              TOP1 + ["parallel.pp=2", "parallel.ep=2", "parallel.zero=3", "parallel.schedule=zb-h1"]], world=4)


# DeepSeek-V3's auxiliary-loss-free balancing (its bias_rate, 0.001: at 0.01 the bias outweighs this
# small router's scores and the second layer's swings back to zero at step 2) beside a shared expert,
# sigmoid scores and the z-loss
BIAS = MOE + ["model.moe.expert_d_ff=16", "model.moe.shared_experts=1", "model.moe.score=sigmoid",
              "model.moe.balance=bias", "model.moe.z_loss_weight=0.001"]


def test_pp2_with_bias_balancing():
    """balance=bias at pp=2 (1F1B and ZB-H1's split backward): each stage moves the expert bias of its
    own layer by that layer's load over the global batch after every step, so the bias of each layer,
    on the stage that holds it, equals one process's exactly, and it moved."""
    layouts = [BIAS + ["parallel.pp=2"], BIAS + ["parallel.pp=2", "parallel.schedule=zb-h1"]]
    runs = compare(layouts, 2, _same_moe_statistics)
    ref = train_random(0, 1, BIAS, steps=STEPS)["expert_bias"][0]
    assert set(ref) == {"0", "1"} and all(any(b) for b in ref.values()), f"expert bias {ref}: two layers, moved"
    for layout, run in zip(layouts, runs):
        stages = run["expert_bias"]  # per rank: {layer: bias} of the layers it holds
        assert [set(s) for s in stages] == [{"0"}, {"1"}], f"{layout}: layers {stages}"
        assert {k: v for s in stages for k, v in s.items()} == ref, f"{layout}: expert bias differs"


@pytest.mark.long
def test_pp2_compiled_per_block():
    _compare([["parallel.pp=2", "train.compile=true", "memory.recompute=full"]], world=2)
