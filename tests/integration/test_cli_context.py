"""Context parallelism through the CLI: `--nproc 2 --set parallel.cp=2` with ZeRO-3 (sharded over dp x cp)
trains with packed documents (data.document_mask, the end-of-text id read from the run's tokenizer) like
one process, and the run saved at cp=2 continues at cp=1 without ZeRO (cp shards no state of its own),
equal to the run that never changed layout.
Tolerance: 1e-5 relative on every step's loss (fp32). The corpus' documents (stdlib files) are long,
so few 64-token samples hold a boundary: the masking itself is tests/dist/test_context_parallel.py's."""

import json

import pytest

from tests.integration.runner import metrics

pytestmark = pytest.mark.slow

# constant lr: a cosine schedule depends on train.steps, which the halves of a resumed run set differently
SETS = ["optim.schedule=constant", "optim.warmup_steps=2", "train.eval_batches=0", "data.document_mask=true"]


def test_cp2_with_documents_resumes_at_cp1(cli, tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    cli.train(straight, *SETS, steps=6)
    two = cli.train(run, *SETS, "parallel.cp=2", "parallel.zero=3", steps=3, nproc=2)
    assert "cp=2 (ring)" in two.stderr, two.stderr
    saved = (run / "config.toml").read_text()
    assert "eot_id = 0" in saved  # the tokenizer's <|endoftext|>, recorded for --resume
    proc = cli.train(run, *SETS, "parallel.cp=1", "parallel.zero=0", steps=6, resume=True, nproc=1)
    assert "parallel.cp: 2 -> 1" in proc.stderr, proc.stderr
    a, b = metrics(straight), metrics(run)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["tokens"] == 8 * 64  # counted once
