"""bench/memory_savers.py --smoke runs on CPU and its numbers hold together: the measured saved
bytes and optimizer-state bytes equal the planner's predictions, int8 compression shrinks what is
saved, and the optimizers order by state size as their papers say."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_memory_savers_smoke(tmp_path):
    out = tmp_path / "savers.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "memory_savers.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    acts = {(a["recompute"], a["compress"]): a for a in r["activations"]}
    for a in acts.values():
        assert abs(a["saved_bytes"] - a["saved_bytes_planned"]) <= 8  # the loss scalar
        assert a["tokens_per_s"] > 0
    assert acts[("none", "int8")]["saved_bytes"] < 0.7 * acts[("none", "none")]["saved_bytes"]
    assert acts[("selective", "int8")]["saved_bytes"] < acts[("none", "int8")]["saved_bytes"]
    opts = {(o["optimizer"], tuple(o["settings"])): o for o in r["optimizers"]}
    for o in opts.values():
        assert o["state_bytes"] == o["state_bytes_planned"]
    adamw, adafactor = opts[("adamw", ())]["state_bytes"], opts[("adafactor", ())]["state_bytes"]
    sm3, sm3_plain = opts[("sm3", ())]["state_bytes"], opts[("sm3", ("optim.momentum=0",))]["state_bytes"]
    assert sm3_plain < adafactor < sm3 < adamw  # SM3 alone: rows + columns; its momentum adds one full buffer
    lora = r["lora"][0]
    assert lora["model_state_bytes"] == lora["model_state_bytes_planned"]
    assert lora["trainable_params"] < 0.2 * lora["params"]
