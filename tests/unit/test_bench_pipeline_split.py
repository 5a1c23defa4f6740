"""bench/pipeline_split.py (CPU) end to end in its --smoke mode: I + W against B on a tiny stage, every
count compared with B's own."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import pipeline_split  # noqa: E402


def test_pipeline_split_account_smoke(tmp_path, monkeypatch):
    out = tmp_path / "split.json"
    monkeypatch.setattr(sys, "argv", ["pipeline_split.py", "--smoke", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        pipeline_split.main()
    finally:
        torch.set_num_threads(threads)  # the script runs on one thread
    result = json.loads(out.read_text())
    ratio = result["account"]["I+W_over_B"]
    assert ratio["flops"] == ratio["kernels"] == ratio["copy_bytes"] == 1 and not result["account"]["kernels_by_op"]
    assert result["account"]["I"]["engine_calls"] == result["account"]["B"]["engine_calls"] == 1
    assert all(row["B"] > 0 and row["I"] > 0 and row["W"] > 0 for row in result["host_ms"].values())
