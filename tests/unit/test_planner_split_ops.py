"""planner/time.py OPS_SPLIT_EXTRA against a live count of ZB-H1's split backward on its last stage
(bench/split_cost.py on a fake process group, CPU), and where the planner charges it."""

import json
import subprocess
import sys
from pathlib import Path

from teratrain.planner.hardware import GPUS
from teratrain.planner.layout import Layout
from teratrain.planner.search import evaluate
from teratrain.planner.time import OPS_SPLIT_EXTRA, split_ops

ROOT = Path(__file__).resolve().parents[2]


def test_the_split_backward_issues_the_counted_ops_per_block(tmp_path):
    out = tmp_path / "split.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "split_cost.py"), "--smoke", "--count-only",
                           "--layers", "4", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slope = json.loads(out.read_text())["split_extra_ops_per_block_mb_slope"]
    assert abs(slope - OPS_SPLIT_EXTRA) <= 0.05 * OPS_SPLIT_EXTRA, slope


def test_only_a_split_schedule_pays_the_host_for_it():
    from teratrain.config import load_config
    from teratrain.planner.inputs import shape_of, training_of

    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=8", "train.global_batch=16", "train.micro_batch=2"])
    shape, train, gpu = shape_of(cfg), training_of(cfg), GPUS["h200"]
    lays = {s: Layout(pp=2, tp=2, micro_batch=2, num_microbatches=8, schedule=s) for s in ("1f1b", "zb-h1")}
    assert split_ops(shape, lays["1f1b"]) == 0
    assert split_ops(shape, lays["zb-h1"]) == 4 * OPS_SPLIT_EXTRA * 8  # 4 blocks a stage, 8 micro-batches
    host = {s: evaluate(shape, train, lay, gpu).time.terms["host_s"] for s, lay in lays.items()}
    assert abs(host["zb-h1"] - host["1f1b"] - 4 * OPS_SPLIT_EXTRA * 8 * gpu.host_op_s) < 1e-12
