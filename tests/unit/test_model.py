"""The decoder: parameter counts by arithmetic equal the live module's, the KV cache decodes exactly
what a full forward computes, and init is a pure function of the seed."""

from pathlib import Path

import pytest
import torch

import teratrain.models
from teratrain.models.sampling import sample
from teratrain.models.transformer import Transformer, build_model, count_params, lm_loss
from teratrain.planner.layout import ModelShape
from tests.helpers import make_config, model_config, small_model


def live_count(cfg) -> int:
    """Parameters of the module built on the meta device (shapes, no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("keys", [
    dict(arch="llama"),
    dict(arch="llama", tie_embeddings=True),
    dict(arch="llama", bias=True),
    dict(arch="llama", n_kv_heads=1, d_ff=None),
    dict(arch="gpt2", tie_embeddings=True),
    dict(arch="gpt2", tie_embeddings=False),
    dict(arch="gpt2", bias=False, d_ff=None),
    dict(arch="llama", qkv_bias=True, qk_norm="head"),
    dict(arch="llama", n_kv_heads=1, qk_norm="full"),
    dict(arch="llama", head_dim=12, qk_norm="head"),  # heads wider than d_model / n_heads (Qwen3-MoE 30B-A3B)
    dict(arch="gpt2", head_dim=6, n_kv_heads=None),  # and narrower
], ids=str)
def test_count_params_equals_the_materialized_module(keys):
    """count_params' total and the planner's (name, shape) list, in order, equal the live module's."""
    cfg = model_config(**keys)
    model = build_model(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    live = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert ModelShape(cfg=cfg).param_shapes() == live


@pytest.mark.parametrize("preset, published", [
    ("gpt2-124m", 124_439_808),     # GPT-2 small, tied head, with learned positions
    ("llama-1b", 1_235_814_400),    # Llama 3.2 1B model card
    ("llama-8b", 8_030_261_248),    # Llama 3.1 8B
    ("llama-70b", 70_553_706_496),  # Llama 3.1 70B
    ("gpt2-350m", None), ("gpt2-774m", None), ("gpt2-1.5b", None), ("tiny", None),
])
def test_preset_param_counts(preset, published):
    cfg = make_config(f"model.preset={preset}").model
    assert count_params(cfg)["total"] == live_count(cfg)
    if published is not None:
        assert live_count(cfg) == published


@pytest.mark.parametrize("tied", [False, True])
def test_tied_head_shares_the_embedding(tied):
    cfg = model_config(tie_embeddings=tied)
    untied_total = count_params(model_config(tie_embeddings=False))["total"]
    assert untied_total - count_params(cfg)["total"] == (cfg.vocab_size * cfg.d_model if tied else 0)
    assert count_params(cfg)["matmul"] == count_params(model_config(tie_embeddings=False))["matmul"]
    # Tied, the head's gradient lands in the embedding: rows of tokens absent from the input get one too.
    model = build_model(cfg)
    x = torch.randint(0, 10, (2, 9))  # tokens 10.. never appear
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    unused_rows = model.tok_embeddings.weight.grad[10:]
    assert bool(unused_rows.abs().sum() > 0) == tied


def test_init_is_a_function_of_the_seed():
    a, b, c = small_model(seed=3), small_model(seed=3), small_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert torch.all(sa["norm.weight"] == 1)


def test_initial_loss_is_near_uniform():
    model = small_model(vocab_size=200)
    x = torch.randint(0, 200, (4, 17))
    with torch.no_grad():
        logits = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    assert abs(loss.item() - torch.log(torch.tensor(200.0)).item()) < 0.1


def test_sequence_longer_than_seq_len_is_refused():
    model = small_model(seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


CACHE_ARCHS = [dict(arch="llama", n_kv_heads=2), dict(arch="llama", n_kv_heads=4), dict(arch="gpt2"),
               dict(arch="llama", n_kv_heads=2, qkv_bias=True, qk_norm="head")]


@pytest.mark.parametrize("keys", CACHE_ARCHS, ids=str)
def test_kv_cache_incremental_decode_equals_full_forward(keys):
    model = small_model(**keys).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)  # (B, T, V)
        caches = model.make_caches(2, 12)
        steps = [model(x[:, :5], caches=caches, start=0)]  # prefill
        steps += [model(x[:, t:t + 1], caches=caches, start=t) for t in range(5, 12)]  # one token at a time
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-12)


def test_kv_cache_chunked_continuation_equals_full_forward():
    """A multi-token step after the prefill (speculative decoding, chunked prefill) must see every
    cached position plus the causal part of its own chunk."""
    model = small_model().eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        caches = model.make_caches(2, 12)
        model(x[:, :5], caches=caches, start=0)
        chunk = model(x[:, 5:8], caches=caches, start=5)
    torch.testing.assert_close(chunk, full[:, 5:8], rtol=1e-10, atol=1e-12)


def test_greedy_sampling_with_cache_equals_argmax_of_full_forwards():
    model = small_model(arch="gpt2").eval()
    prompt = [3, 1, 4, 1, 5]
    got = sample(model, prompt, max_new_tokens=8, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_sampling_is_reproducible_by_seed_and_respects_seq_len():
    model = small_model().eval()
    a = sample(model, [1, 2, 3], max_new_tokens=100, temperature=1.0, top_k=10, seed=7)
    b = sample(model, [1, 2, 3], max_new_tokens=100, temperature=1.0, top_k=10, seed=7)
    assert a == b and len(a) == model.cfg.seq_len - 3
    assert all(0 <= t < model.cfg.vocab_size for t in a)


def test_models_never_import_torch_distributed():
    """models/ is single-device code; strategies wrap it from outside (parallel/parallelize.py)."""
    for f in Path(teratrain.models.__file__).parent.glob("*.py"):
        assert "torch.distributed" not in f.read_text(), f.name


def test_train_deterministic_switches_torch_to_deterministic_kernels_and_back():
    """train.deterministic (checkpoint/state.py): on, torch refuses nondeterministic kernels (an op
    without a deterministic one raises) and cuBLAS gets its fixed workspace; the next run without it
    turns it off again (the flag is process-wide)."""
    import os

    from teratrain.checkpoint.state import deterministic_algorithms

    try:
        deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
    finally:
        deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()
