"""Hugging Face in, train, Hugging Face out: a tiny random Llama and Mixtral (saved here with
save_pretrained, no download) imported with model.init_from, trained two steps at model.seq_len=32 and
exported with `teratrain export`. The exported config.json equals the source's but for the keys the
run changed, and only those:

- `dtype` (`torch_dtype` in transformers 4): the export's --dtype;
- `attention_dropout` (GPT-2: its *_pdrop): model.dropout;
- `rms_norm_eps`, `rope_theta`/`rope_scaling` (`rope_parameters` in transformers 5): model.norm_eps,
  model.rope_theta, model.rope_scaling;
- Mixtral's `router_aux_loss_coef` and `output_router_logits`: model.moe.aux_loss_weight and
  aux_loss_convention (transformers adds the aux loss only with output_router_logits true).

`max_position_embeddings` is the model's context, not the training length: it comes back as it came in.
"""

import json

import numpy as np
import pytest

from teratrain.config import load_config
from tests.hf_models import LLAMA3_SCALING, save_llama, save_mixtral, save_moe

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def round_trip(cli, tmp_path, *sets: str, name: str = "run") -> tuple[dict, dict, str]:
    """(source config.json, exported config.json, the run's start-up summary) of a run `name` of the
    model in tmp_path/src with `sets`, on random token ids below its 50-token vocabulary."""
    ids = tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, 50, 20_000, dtype=np.uint16).tofile(ids)
    run, out = tmp_path / name, tmp_path / f"{name}-hf"
    base = [f"model.init_from={str(tmp_path / 'src')!r}", f"data.path={str(ids)!r}", "model.seq_len=32",
            "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=0", "metrics.progress=false"]
    proc = cli("train", "--out", run, "--steps", 2, *[a for s in base + list(sets) for a in ("--set", s)],
               in_process=True)
    cli("export", "--ckpt", run, "--to", out, in_process=True)
    source = json.loads((tmp_path / "src" / "config.json").read_text())
    return source, json.loads((out / "config.json").read_text()), proc.stderr


def differing(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in {*a, *b} if a.get(k) != b.get(k)}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_an_moe_model_with_a_moe_key_comes_back_as_it_came_in(cli, tmp_path, family):
    """A model.moe key beside model.init_from keeps the experts of config.json (the run would fail to
    load the weights otherwise). The source trains with no aux loss (output_router_logits false): so
    does the run, and the export writes router_aux_loss_coef 0.001 and false back unchanged. Qwen2-MoE:
    its shared expert, dense first layer and q/k/v biases come back as they came in too."""
    if family == "mixtral":
        save_mixtral(tmp_path / "src", max_position_embeddings=4096)
    else:
        save_moe(tmp_path / "src", family, max_position_embeddings=4096)
    source, exported, err = round_trip(cli, tmp_path, "model.moe.aux_loss_weight=0")
    assert differing(source, exported) == {}
    assert f"({family}, 2 layers, d_model 32, 4 experts x top-2" in err  # Qwen2-MoE: then its widths
    assert "moe: aux loss 0 from config.json (output_router_logits false: transformers trains with none" in err
    cfg = load_config(tmp_path / "run" / "config.toml").model.moe
    assert (cfg.num_experts, cfg.aux_loss_weight) == (4, 0.0)


def test_mixtral_aux_loss_is_read_and_written_back(cli, tmp_path):
    """output_router_logits true: the run takes transformers' loss at router_aux_loss_coef and the
    export gives both back; a weight the user sets is the only key that changes."""
    save_mixtral(tmp_path / "src", output_router_logits=True, router_aux_loss_coef=0.003)
    source, exported, err = round_trip(cli, tmp_path)
    assert differing(source, exported) == {}
    assert "moe: aux loss 0.003 from config.json (router_aux_loss_coef; output_router_logits true" in err
    moe = load_config(tmp_path / "run" / "config.toml").model.moe
    assert (moe.aux_loss_weight, moe.aux_loss_convention) == (0.003, "transformers")

    source, exported, _ = round_trip(cli, tmp_path, "model.moe.aux_loss_weight=0.02", name="changed")
    assert differing(source, exported) == {"router_aux_loss_coef": (0.003, 0.02)}


def test_llama_keeps_its_context_and_writes_what_the_run_changed(cli, tmp_path):
    """Trained at seq_len 32, the Llama (Llama 3 RoPE scaling, 4096-token context) is exported with
    its 4096; model.dropout is the one key given that maps to config.json (attention_dropout)."""
    save_llama(tmp_path / "src", max_position_embeddings=4096, rope_scaling=LLAMA3_SCALING)
    source, exported, err = round_trip(cli, tmp_path, "model.dropout=0.1")
    assert differing(source, exported) == {"attention_dropout": (0.0, 0.1)}
    assert exported["max_position_embeddings"] == 4096
    assert "(llama, 2 layers, d_model 32)" in err and "moe:" not in err
