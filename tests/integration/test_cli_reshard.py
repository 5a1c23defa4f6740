"""--nproc and --resume at another layout through the CLI: a run saved by 2 processes with ZeRO-3 (equal
to one process while it runs) continues in one process (another precision and ZeRO stage too), equal
to the run that never changed layout; an unusable newest checkpoint (a truncated piece of another rank's file, a wrong index) is skipped with a
warning and the previous one is used."""

import hashlib
import json

import pytest

from tests.helpers import truncate
from tests.integration.runner import latest_checkpoint, metrics

pytestmark = pytest.mark.slow

# constant lr: a cosine schedule depends on train.steps, which the halves of a resumed run set differently
SETS = ["optim.schedule=constant", "optim.warmup_steps=2", "train.eval_batches=0", "checkpoint.keep=3"]


def test_zero3_on_two_processes_resumes_in_one(cli, tmp_path):
    """`--nproc 2` with ZeRO-3 trains like one process (the same losses on the same global batch, half
    the parameters per rank, a file per rank), then continues in one process."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    cli.train(straight, *SETS, steps=6)
    two = cli.train(run, *SETS, "parallel.zero=3", steps=3, nproc=2)
    assert "done: 3 steps" in two.stdout
    assert metrics(run)[0]["model_state_bytes"]["params"] < 0.51 * metrics(straight)[0]["model_state_bytes"]["params"]
    assert (run / "checkpoints" / "step_00000003" / "rank00001.safetensors").exists()
    proc = cli.train(run, *SETS, "parallel.zero=0", steps=6, resume=True, nproc=1)
    assert "Traceback" not in proc.stderr
    a, b = metrics(straight), metrics(run)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])


def test_resume_in_another_precision_and_zero_stage(cli, trained_run, tmp_path):
    """fp32 AdamW (no masters) resumed as fp16 with fp32 masters under ZeRO-1: the masters start from the
    saved fp32 values, the moments carry over."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    cli.train(run, "optim.warmup_steps=10", "metrics.peak_tflops=1", "checkpoint.every=25", "memory.precision=fp16",
              "parallel.zero=1", steps=52, resume=True)
    assert [r["step"] for r in metrics(run)][-3:] == [50, 51, 52]
    assert latest_checkpoint(run).name == "step_00000052"


@pytest.mark.long
def test_a_truncated_piece_or_a_wrong_index_falls_back(cli, tmp_path):
    run = tmp_path / "run"
    cli.train(run, *SETS, "parallel.zero=3", "checkpoint.every=2", steps=6, nproc=2)
    root = run / "checkpoints"
    truncate(root / "step_00000004" / "rank00001.safetensors")  # read by the one process that resumes
    newest = root / "step_00000006"
    index = json.loads((newest / "index.json").read_text())
    entry = next(t for t in index["tensors"].values() if t["kind"] == "param" and len(t["pieces"]) == 2)
    entry["pieces"][1]["flat"][0] += 1  # one element of one tensor is no longer covered
    data = json.dumps(index).encode()
    (newest / "index.json").write_bytes(data)  # and its digest updated: only reading the index can tell
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["index.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / "meta.json").write_text(json.dumps(meta))

    proc = cli.train(run, *SETS, "parallel.zero=0", "checkpoint.every=2", steps=7, resume=True, nproc=1)

    assert "Traceback" not in proc.stderr and "teratrain: warning:" in proc.stderr, proc.stderr
    assert "resuming from step_00000002" in proc.stderr, proc.stderr
    assert "truncated" in proc.stderr and "index" in proc.stderr, proc.stderr
    assert [r["step"] for r in metrics(run)] == list(range(1, 8))
