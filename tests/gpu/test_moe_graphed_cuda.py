"""MoE under CUDA graphs (train.compile_mode=reduce-overhead) on one GPU: the graph recorded once replays at
every step. While the routing statistics were copied into new tensors after each micro-batch, the graph read
them at the addresses it was recorded with, and CUDA graph trees recorded it again at every step of one
micro-batch (one H100, an 8-expert model at the llama-1b width: 0.42x the dense model's speed, 0.79x since;
bench/README.md). The CPU test holds the statistics to the same tensors (tests/unit/test_moe.py); this one
reads torch's own log of re-recordings (`TORCH_LOGS=cudagraphs`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "TORCH_LOGS": "cudagraphs",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.gpu(1)
def test_graphed_experts_are_not_recorded_again_step_after_step(tmp_path):
    done = subprocess.run([sys.executable, "-m", "teratrain", "train", "--out", str(tmp_path / "run"), "--steps", "8",
                           "--set", "model.preset=moe-tiny", "--set", "model.moe.capacity_factor=0",
                           "--set", "memory.precision=bf16", "--set", "train.global_batch=8",
                           "--set", "train.micro_batch=8", "--set", "train.eval_batches=0",
                           "--set", "train.compile=true", "--set", "train.compile_mode=reduce-overhead"],
                          capture_output=True, text=True, timeout=600, env=ENV)
    out = done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 8 steps" in out
    assert "Re-recording" not in out, [line for line in out.splitlines() if "Re-recording" in line][:3]
