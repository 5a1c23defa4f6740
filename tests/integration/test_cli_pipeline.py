"""`teratrain train --nproc 2 --set parallel.pp=2` end to end: the same losses as one process, every
rank's metrics carry the last stage's loss, `pipeline.png` is written, `teratrain generate` reads the
run; bad pipeline layouts fail before launch with one sentence; `bench/pipeline.py --smoke` runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from teratrain.metrics import read_metrics
from tests.integration.runner import assert_user_error

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_pp2_run_matches_one_process_writes_its_timeline_and_generates(cli, tmp_path):
    sets = ["train.eval_batches=2", "train.eval_every=2", "optim.lr=0.01", "train.micro_batch=2"]
    cli.train(tmp_path / "one", *sets, steps=3)
    proc = cli.train(tmp_path / "pp", *sets, "parallel.pp=2", "parallel.schedule=zb-h1", steps=3, nproc=2)
    assert "done: 3 steps" in proc.stdout
    one, pp = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "pp" / "metrics.jsonl")
    for a, b in zip(one, pp):  # rank 0 holds the first stage: its loss is the last stage's, broadcast
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert ("eval_loss" in a) == ("eval_loss" in b)
        if "eval_loss" in a:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * abs(a["eval_loss"])
    png = tmp_path / "pp" / "pipeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (tmp_path / "one" / "pipeline.png").exists()
    out = cli("generate", "--ckpt", tmp_path / "pp", "--prompt", "def ", "--max-new-tokens", 8, "--temperature", 0,
              in_process=True).stdout
    ref = cli("generate", "--ckpt", tmp_path / "one", "--prompt", "def ", "--max-new-tokens", 8, "--temperature", 0,
              in_process=True).stdout
    assert out.startswith("def ") and out == ref, "the pp=2 checkpoint holds the one-process model"


BAD_LAYOUTS = [
    (["parallel.pp=2", "model.n_layers=3"], ["parallel.partition=layers", "model.n_layers=3", "profiled"]),
    (["parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "model.n_layers=4",
      "train.micro_batch=8"],  # 1 micro-batch per step, fewer than the 2 ranks
     ["interleaved-1f1b", "multiple of parallel.pp=2"]),
    (["parallel.pp=2", "parallel.zero=3", "parallel.schedule=pipedream"], ["parallel.zero=3", "parallel.zero<=2"]),
    (["parallel.pp=2", "parallel.stage_layers=[2,1]"], ["parallel.stage_layers=[2, 1]", "model.n_layers"]),
]


@pytest.mark.parametrize("sets, words", [pytest.param(s, w, id=s[-1]) for s, w in BAD_LAYOUTS])
def test_bad_pipeline_layout_fails_before_launch(cli, tmp_path, sets, words):
    proc = cli.train(tmp_path / "run", *sets, nproc=2, expect_rc=None, in_process=True)
    assert_user_error(proc, *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.long
def test_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline.py"), "--smoke", "--profile"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    rows = result["schedules"]
    assert {(r["schedule"], r["m"]) for r in rows} == {(s, m) for s in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
                                                       for m in (4, 8)}
    assert all(r["tokens_per_s"] > 0 and 0 <= r["bubble_simulated"] < 1 and 0 <= r["bubble_measured"] < 1 for r in rows)
    zb = next(r for r in rows if r["schedule"] == "zb-h1")
    first, last = zb["stage_ms"]  # stage 0 joins I and W: its input gradient goes to no other rank
    assert {"F", "B"} <= set(first) and {"F", "I", "W"} <= set(last) and len(zb["transfer_ms"]) == 1
    assert [v["m"] for v in result["interleaved_vs_torch"]] == [4, 8]
    assert [z["m"] for z in result["zb_vs_1f1b"]] == [4, 8] and [o["m"] for o in result["one_gpu"]] == [4, 8]
    h100, h200 = result["sizing"]["h100"], result["sizing"]["h200"]  # what the GPUs would run, by the planner
    assert h200["layers"] > h100["layers"] >= 4 and all(s["planned_gib"] <= s["limit_gib"] for s in (h100, h200))
    for name, kinds in (("1f1b", [{"F", "B"}, {"F", "B"}]), ("zb-h1", [{"F", "B"}, {"F", "I", "W"}])):
        assert [set(r["host_ms"]) for r in result["profile"][name]] == kinds, result["profile"][name]
