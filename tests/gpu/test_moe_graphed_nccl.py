"""MoE with expert parallelism under CUDA graphs (train.compile_mode=reduce-overhead) under NCCL: the
training commands that exercise what a graph replay can get wrong (2 x H200).

- bf16 (the experts' grouped GEMM reads nothing back): `teratrain train --nproc 2` at ep=2 with
  accumulation and evaluations. The routing statistics are copied out of the graph pool after each
  micro-batch; left there, the next step's replay would overwrite them before they are read.
- fp32: the experts' grouped GEMM reads its row offsets back to the host, which a capture cannot hold. The
  run is refused before it starts (parallel/support.py check_supported, which the CLI calls first), in one
  sentence with the fix, rather than failing inside the first capture.
The CPU tests cover both on their own (tests/unit/test_moe.py, tests/unit/test_config.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
MOE_EP2_GRAPHED = ["--set", "model.moe.num_experts=4", "--set", "parallel.ep=2", "--set", "model.moe.capacity_factor=1.25",
                   "--set", "train.compile=true", "--set", "train.compile_mode=reduce-overhead"]


def _train(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teratrain", "train", "--nproc", "2", "--out", str(tmp_path / "run"),
                           "--steps", "12", "--set", "train.global_batch=64", "--set", "train.eval_every=6",
                           *MOE_EP2_GRAPHED, *sets], capture_output=True, text=True, timeout=600, env=ENV)


@pytest.mark.gpu(2)
def test_train_runs_graphed_experts_in_bf16(tmp_path):
    done = _train(tmp_path, "--set", "memory.precision=bf16")  # 2 micro-batches of 16 a rank
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 12 steps" in done.stdout + done.stderr


@pytest.mark.gpu(2)
def test_train_refuses_graphed_experts_in_fp32(tmp_path):
    done = _train(tmp_path)
    assert done.returncode != 0
    assert "set memory.precision=bf16 or train.compile_mode=default" in done.stdout + done.stderr
    assert not (tmp_path / "run").exists()  # refused before the run started
