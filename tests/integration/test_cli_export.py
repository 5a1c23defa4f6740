"""`teratrain export`: a trained run becomes a Hugging Face folder that transformers loads with the same
logits (fp32, 1e-5 relative), sharded with an index above --max-shard-gb, with the run's tokenizer; and
exporting then importing it (model.init_from) gives back every parameter exactly."""

import json

import pytest
import torch

from teratrain.checkpoint import find_valid
from teratrain.checkpoint.consolidate import full_model, load_weights
from teratrain.config import load_config
from teratrain.models.transformer import Transformer, build_model
from teratrain.parallel.parallelize import init_fn
from teratrain.parallel.placement import assign_defaults, materialize
from tests.integration.runner import assert_user_error

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def our_model(run):
    cfg = load_config(run / "config.toml")
    model = build_model(cfg.model)
    load_weights(model, find_valid(run / "checkpoints")[0])
    return model.eval()


def assert_same_logits(ours, folder, vocab):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), hf(tokens).logits
    err = float((a - b).norm() / b.norm())
    assert err < 1e-5, f"logits differ by {err:.2e}"
    return hf


def assert_import_gives_back_the_run(run, folder, *sets):
    """A model built from model.init_from of the exported `folder` (on the meta device, then
    materialized on the CPU) holds exactly the parameters of the run's last valid checkpoint."""
    cfg = load_config(None, [f"model.init_from={str(folder)!r}", *sets])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assign_defaults(model)
    materialize(model, "cpu", init_fn(cfg))
    saved = full_model(find_valid(run / "checkpoints")[0])
    assert saved.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name


def test_export_llama_loads_in_transformers_with_the_same_logits(cli, trained_run, tmp_path):
    out = tmp_path / "hf"
    proc = cli("export", "--ckpt", trained_run, "--to", out, in_process=True)
    assert "LlamaForCausalLM" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"]
    hf = assert_same_logits(our_model(trained_run), out, 4096)
    assert type(hf).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from tokenizers import Tokenizer

    text = "def main(argv):\n    return 0\n"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(trained_run / "tokenizer.json")).encode(text).ids


def test_export_gpt2_in_shards_then_import_gives_the_same_parameters(cli, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    cli.train(run, "model.arch=gpt2", "model.tie_embeddings=true", "model.bias=true", "model.n_kv_heads=4",
              "train.eval_batches=0", steps=3)
    cli("export", "--ckpt", run, "--to", out, "--max-shard-gb", "0.0005", in_process=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "transformer.h.0.attn.c_attn.weight" in index["weight_map"]
    assert_same_logits(our_model(run), out, 4096)

    assert_import_gives_back_the_run(run, out, "model.seq_len=64")


EXPORTED = {  # model keys -> the transformers class the export is loaded as
    "qwen2": (["model.qkv_bias=true"], "Qwen2ForCausalLM"),
    "qwen3": (["model.qk_norm=head"], "Qwen3ForCausalLM"),
    "mixtral": (["model.moe.num_experts=4"], "MixtralForCausalLM"),
    "qwen2_moe": (["model.moe.num_experts=4", "model.moe.expert_d_ff=64", "model.moe.shared_experts=1",
                   "model.moe.shared_gate=true", "model.moe.norm_topk=false", "model.moe.first_dense_layers=1",
                   "model.qkv_bias=true"], "Qwen2MoeForCausalLM"),
    "qwen3_moe": (["model.moe.num_experts=4", "model.moe.expert_d_ff=64", "model.qk_norm=head"], "Qwen3MoeForCausalLM"),
    "qwen3_moe_wide_heads": (["model.moe.num_experts=4", "model.moe.expert_d_ff=64", "model.qk_norm=head",
                              "model.head_dim=48"], "Qwen3MoeForCausalLM"),  # 4 x 48 at d_model 128
    "olmoe": (["model.moe.num_experts=4", "model.moe.norm_topk=false", "model.qk_norm=full"], "OlmoeForCausalLM"),
}


@pytest.mark.parametrize("family", EXPORTED)
def test_export_of_each_family_then_import_gives_the_same_logits_and_parameters(cli, tmp_path, family):
    """A run with q/k/v biases, with per-head q/k norms (also on heads wider than d_model / n_heads), with
    softmax-topk experts (no capacity limit:
    in every layer, with a gated shared expert after a dense first layer, with q/k norms) becomes a
    folder of that family whose transformers logits equal ours; its model.init_from gives back every
    parameter."""
    sets, architecture = EXPORTED[family]
    run, out = tmp_path / "run", tmp_path / "hf"
    cli.train(run, *sets, "train.eval_batches=0", steps=2, in_process=True)
    assert architecture in cli("export", "--ckpt", run, "--to", out, in_process=True).stdout
    hf = assert_same_logits(our_model(run), out, 4096)
    assert type(hf).__name__ == architecture
    assert_import_gives_back_the_run(run, out)


def test_export_refuses_an_existing_folder(cli, trained_run, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    proc = cli("export", "--ckpt", trained_run, "--to", tmp_path / "taken", expect_rc=None, in_process=True)
    assert_user_error(proc, "--to", "already exists")


def test_export_of_a_lora_run_folds_the_adapters_in(cli, tmp_path):
    """W + (alpha / r) B A for every adapted layer: the exported model gives the logits of the trained
    model with its adapters (generate's merge), not those of the frozen base; generate runs on it."""
    from safetensors.torch import load_file

    from teratrain.memory.lora import merge_from_checkpoint

    run, out = tmp_path / "run", tmp_path / "hf"
    cli.train(run, "lora.rank=4", "optim.lr=0.01", "optim.warmup_steps=0", "train.eval_batches=0", steps=3)
    assert_user_error(cli("export", "--ckpt", run, "--to", out, expect_rc=None, in_process=True), "--merge")
    cli("export", "--ckpt", run, "--to", out, "--merge", in_process=True)
    cfg = load_config(run / "config.toml")
    model = our_model(run)
    base_wq = model.layers["0"].attention.wq.weight.detach().clone()
    merge_from_checkpoint(model, find_valid(run / "checkpoints")[0], cfg.lora.alpha)
    assert_same_logits(model, out, 4096)
    exported = load_file(out / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(exported, base_wq), "the adapters were not folded in"
    assert cli("generate", "--ckpt", run, "--prompt", "def ", "--max-new-tokens", 4, in_process=True).stdout


def test_a_named_checkpoint_folder_is_verified_before_it_is_read(cli, trained_run, tmp_path):
    """--ckpt naming one step_* folder gets the checks a run directory's newest checkpoint gets: a corrupt
    tensor file is one sentence (with the run directory as the fix), not NaN weights exported."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    tensors = next(step.glob("*.safetensors"))
    data = bytearray(tensors.read_bytes())
    data[-4096:] = b"\xff" * 4096
    tensors.write_bytes(bytes(data))
    proc = cli("export", "--ckpt", step, "--to", tmp_path / "hf", expect_rc=None, in_process=True)
    assert_user_error(proc, f"--ckpt '{step}' cannot be used", "fails its sha256 digest (corrupted)",
                      f"give the run directory {run}")
    assert not (tmp_path / "hf").exists()


def test_merge_without_adapters_is_refused(cli, trained_run, tmp_path):
    proc = cli("export", "--ckpt", trained_run, "--to", tmp_path / "hf", "--merge", expect_rc=None, in_process=True)
    assert_user_error(proc, "--merge folds LoRA adapters", "trained none", "export without --merge")
