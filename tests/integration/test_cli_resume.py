"""--resume continues a run bitwise: 16 steps straight == 8 steps, then --resume to 16.

The schedule is constant after warmup because cosine/linear decay depend on train.steps, which the two
halves of a resumed run set differently (8, then 16). Dropout is on, so the RNG must resume too.
"""

import json

import pytest
import torch

from tests.helpers import flip_byte
from tests.integration.runner import checkpoint_tensors, latest_checkpoint, metrics

# train.eval_batches=1: the 8-step half still evaluates (in eval mode, so it must not move the dropout RNG)
RESUME_SETS = ["model.dropout=0.1", "optim.schedule=constant", "optim.warmup_steps=4", "train.eval_batches=1"]
# fp16 with a short growth window: the scale grows at steps 3, 6, 9, ...; the checkpoint at step 8 lands
# mid-window (2 clean steps), so a resume that lost the scaler state would grow it at the wrong step.
# fp16 matmuls are slow on CPU: one micro-batch per step and no evaluation keep this test short.
FP16_SETS = ["memory.precision=fp16", "memory.loss_scale_window=3", "train.global_batch=4", "train.micro_batch=4",
             "train.eval_batches=0"]

pytestmark = pytest.mark.slow


def straight_and_resumed(cli, root, *sets):
    straight, resumed = root / "straight", root / "resumed"
    cli.train(straight, *RESUME_SETS, *sets, steps=16)
    cli.train(resumed, *RESUME_SETS, *sets, steps=8)
    assert latest_checkpoint(resumed).name == "step_00000008"
    cli.train(resumed, *RESUME_SETS, *sets, steps=16, resume=True)
    return straight, resumed


@pytest.fixture(scope="module")
def fp32_runs(cli, tmp_path_factory):
    return straight_and_resumed(cli, tmp_path_factory.mktemp("fp32"))


@pytest.fixture(scope="module")
def fp16_runs(cli, tmp_path_factory):
    return straight_and_resumed(cli, tmp_path_factory.mktemp("fp16"), *FP16_SETS)


def assert_same_metrics(straight, resumed, columns):
    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 17))
    for col in columns:
        assert [r[col] for r in b] == [r[col] for r in a], col


def assert_same_checkpoint_tensors(straight, resumed):
    assert latest_checkpoint(resumed).name == "step_00000016"
    ta, tb = checkpoint_tensors(straight), checkpoint_tensors(resumed)
    assert ta.keys() == tb.keys()
    assert any(k.startswith("optim.") for k in ta) and "rng.torch_cpu" in ta
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def rank_state(run) -> dict:
    return json.loads((latest_checkpoint(run) / "rank00000.json").read_text())


def test_resume_is_bitwise_exact(fp32_runs):
    assert_same_metrics(*fp32_runs, columns=("loss", "lr", "grad_norm"))
    assert_same_checkpoint_tensors(*fp32_runs)


def test_resume_is_bitwise_exact_with_fp16_loss_scaling(fp16_runs):
    straight, resumed = fp16_runs
    assert_same_metrics(straight, resumed, columns=("loss", "grad_norm", "loss_scale", "skipped_steps"))
    assert_same_checkpoint_tensors(straight, resumed)
    scales = [r["loss_scale"] for r in metrics(straight)]
    assert any(x != y for x, y in zip(scales[7:], scales[8:])), "the scale must change after the resume point"
    assert rank_state(resumed)["scaler"] == rank_state(straight)["scaler"]
    assert rank_state(resumed)["scaler"]["scale"] == scales[-1]


@pytest.mark.parametrize("runs", ["fp32_runs", "fp16_runs"])
def test_resumed_json_state_equals_straight(runs, request):
    straight, resumed = request.getfixturevalue(runs)
    a, b = rank_state(straight), rank_state(resumed)
    assert a.keys() == b.keys()
    for key in a.keys() - {"rng"}:  # optimizer groups, loss scaler, data position, step
        assert a[key] == b[key], key


def test_python_and_numpy_rng_are_seeded_so_identical_runs_save_identical_state(fp32_runs):
    """Python's `random` and NumPy's global RNG are saved and restored with every checkpoint; for a
    run to be a function of train.seed they must also be seeded from it, not from OS entropy."""
    a, b = (rank_state(r)["rng"] for r in fp32_runs)
    same_python, same_numpy = a["python"] == b["python"], a["numpy"] == b["numpy"]
    assert same_python, "Python's random state differs between two runs of one config"
    assert same_numpy, "NumPy's global RNG state differs between two runs of one config"


@pytest.mark.long
def test_resume_falls_back_past_a_corrupt_newest_checkpoint(cli, tmp_path):
    run = tmp_path / "run"
    cli.train(run, *RESUME_SETS, "checkpoint.every=2", steps=4)
    first = metrics(run)
    flip_byte(run / "checkpoints/step_00000004/rank00000.safetensors")

    proc = cli.train(run, *RESUME_SETS, "checkpoint.every=2", steps=5, resume=True)

    assert "teratrain: warning:" in proc.stderr and "resuming from step_00000002" in proc.stderr, proc.stderr
    assert "step_00000004" in proc.stderr and "Traceback" not in proc.stderr
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5], "metrics logged after step 2 are replaced"
    assert [r["loss"] for r in records[:4]] == [r["loss"] for r in first], "steps 3-4 are redone exactly"
    assert latest_checkpoint(run).name == "step_00000005"


def test_a_run_resumed_on_other_text_reads_it_with_its_own_tokenizer(cli, tmp_path):
    """Resumed on another corpus (data.path changed), the run encodes it with the tokenizer it was trained
    with, not a new one trained on that corpus (which would remap every token id); the same holds where the
    tokenizer its config names has moved away."""
    run, other = tmp_path / "run", tmp_path / "other.txt"
    other.write_text("\n".join(f"a different corpus, line {i}: {'words ' * (i % 7)}" for i in range(3000)))
    cli.train(run, "checkpoint.every=2", steps=2)
    before = (run / "tokenizer.json").read_bytes()
    proc = cli.train(run, f"data.path={json.dumps(str(other))}", steps=4, resume=True)
    assert "BPE tokenizer" not in proc.stderr and (run / "tokenizer.json").read_bytes() == before
    assert len(metrics(run)) == 4


def test_a_parallel_auto_run_resumed_on_another_process_count_is_planned_anew(cli, tmp_path):
    """The saved layout was the pick for 1 process (the whole global batch of 8 as one micro-batch): on 2,
    parallel.auto chooses again instead of refusing the old pick as if the user had fixed it."""
    from tests.helpers import TINY_SETS

    run = tmp_path / "run"
    sets = [a for s in TINY_SETS if not s.startswith("train.micro_batch") for a in ("--set", s)]
    sets += ["--set", f"data.cache_dir={json.dumps(cli.cache)}"]
    cli("train", "--out", run, "--steps", 2, "--nproc", 1, *sets, "--set", "parallel.auto=true", "--set",
        "checkpoint.every=2")
    proc = cli("train", "--out", run, "--steps", 4, "--nproc", 2, "--resume", *sets)
    assert "auto layout: dp=2" in proc.stderr and len(metrics(run)) == 4
