"""Auxiliary-loss-free balancing through the trainer (DeepSeek-V3 sec. 2.1.2): after every optimizer step
each expert's bias moves by bias_rate * sign(mean load - load), the load counted over the step's whole
global batch (every micro-batch of gradient accumulation), once per step. The reference replays that
update in fp64 from the per-step loads of metrics.jsonl; the trained biases come from the checkpoint.
Tolerance: 1e-7 absolute (the bias is an fp32 buffer, 3 steps of 0.01)."""

import json

import pytest

from teratrain.config import load_config
from teratrain.metrics import read_metrics
from teratrain.train import run

RATE, STEPS, BATCH, MICRO, SEQ, K = 0.01, 3, 8, 2, 32, 2
SETS = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", f"model.seq_len={SEQ}", "model.moe.num_experts=8",
        f"model.moe.top_k={K}", "model.moe.router=softmax-topk", "model.moe.balance=bias",
        f"model.moe.bias_rate={RATE}",
        f"train.global_batch={BATCH}", f"train.micro_batch={MICRO}", f"train.steps={STEPS}", "train.eval_batches=0",
        f"checkpoint.every={STEPS}", "metrics.progress=false", "train.device=cpu"]


def test_bias_moves_once_per_step_by_the_whole_steps_load(data_cache, tmp_path):
    run(load_config(None, SETS + [f"data.cache_dir={data_cache}"]), str(tmp_path))
    rows = list(read_metrics(tmp_path / "metrics.jsonl"))
    saved = json.loads((tmp_path / "checkpoints" / f"step_{STEPS:08d}" / "rank00000.json").read_text())["moe_bias"]
    assert len(rows) == STEPS and sorted(saved) == ["0", "1"]
    for key, bias in saved.items():
        ref = [0.0] * len(bias)
        for r in rows:
            load = r["moe"][f"layers.{key}"]["load"]
            assert sum(load) == BATCH * SEQ * K  # every micro-batch's routed choices, not the last one's
            mean = sum(load) / len(load)
            ref = [b + RATE * ((mean > c) - (mean < c)) for b, c in zip(ref, load)]
        assert bias == pytest.approx(ref, abs=1e-7), f"layer {key}"
