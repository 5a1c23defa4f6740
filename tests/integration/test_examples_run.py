"""Every file in examples/ runs as written, at a tiny shape for two steps: each TOML config through
`teratrain train`, examples/own_model.py as a script (its own decoder, and a transformers Llama).

Only the model's size, the batch and the step count are overridden (the shared cached BPE has 4096
tokens), and train.compile (a CPU compile of the GPU example takes a minute; nothing else differs).
moe-ep2.toml needs 2 processes: it runs in test_cli_resume_nproc.py.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from teratrain.config import load_config
from tests.integration.runner import metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPE = ["model.vocab_size=4096", "model.n_kv_heads=2", "model.d_ff=128", "train.eval_batches=1"]
MULTI_PROCESS = {"moe-ep2.toml"}


def test_every_example_is_run_here():
    here = {"own_model.py", *(p.name for p in EXAMPLES.glob("*.toml"))}
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == here
    assert MULTI_PROCESS <= here


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml") if p.name not in MULTI_PROCESS))
def test_toml_example_trains(cli, tmp_path, name):
    path, run = EXAMPLES / name, tmp_path / "run"
    cli.train(run, *SHAPE, "train.compile=false", steps=2, config=path, in_process=True)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    cfg, given = load_config(run / "config.toml"), load_config(path)
    for section in ("memory", "parallel", "optim"):  # what the example is about is kept
        assert getattr(cfg, section) == getattr(given, section).model_copy(update={"dp": 1} if section == "parallel"
                                                                           else {}), section


@pytest.mark.parametrize("hf", [False, True], ids=["own-decoder", "hf-llama"])
def test_own_model_example_trains(cli, tmp_path, monkeypatch, capsys, hf):
    monkeypatch.chdir(tmp_path)
    sets = [*SHAPE, "model.n_layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8",
            "train.micro_batch=4", "train.steps=2", "metrics.progress=false", f"data.cache_dir={json.dumps(cli.cache)}"]
    argv = ["own_model.py", *(["--hf", "llama"] if hf else []), *[a for s in sets for a in ("--set", s)]]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLES / "own_model.py"), run_name="__main__")
    assert [r["step"] for r in metrics(tmp_path / "runs" / "own-model")] == [1, 2]
    name = "LlamaForCausalLM" if hf else "TinyDecoder"  # the summary describes this model, not the preset
    assert f"teratrain: model: {name} (your own, from model_fn)" in capsys.readouterr().err


def test_an_own_model_that_fails_leaves_no_run_folder(cli, tmp_path):
    """The library's run() removes the folder it made when the run ends before its first step."""
    import teratrain
    from torch import nn

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 2)

        def forward(self, tokens, targets=None):
            raise RuntimeError("broken model")

    cfg = teratrain.load_config(None, ["train.steps=2", f"data.cache_dir={json.dumps(cli.cache)}"])
    with pytest.raises(RuntimeError, match="broken model"):
        teratrain.run(cfg, out=str(tmp_path / "run"), model_fn=lambda cfg: Broken())
    assert not (tmp_path / "run").exists()


def test_own_model_example_under_torchrun_reports_once(cli, tmp_path):
    """Two ranks train (data parallelism, ZeRO-3); only rank 0 prints the closing line."""
    sets = [*SHAPE, "model.n_layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8",
            "train.micro_batch=4", "train.steps=2", "metrics.progress=false", "parallel.zero=3",
            f"data.cache_dir={json.dumps(cli.cache)}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "own_model.py"), "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("done:")] == [
        f"done: 2 steps, loss {metrics(tmp_path / 'run')[-1]['loss']:.4f} -> {tmp_path / 'run'}"]
