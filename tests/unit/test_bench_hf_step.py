"""bench/common.py hf_step: transformers' model stepped as the bench's teratrain rows step, with fp32 weights (torch's
AdamW) or bf16 weights over fp32 masters (teratrain's engine), so `--weights bf16` compares like with like."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import config, hf_llama, hf_step  # noqa: E402

SHAPE = ["model.arch=llama", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=64", "model.vocab_size=64", "model.seq_len=16", "model.tie_embeddings=false",
         "memory.precision=bf16", "train.grad_clip=1.0", "optim.lr=1e-2", "train.device=cpu"]


def test_bf16_weights_step_fp32_masters_and_fp32_weights_step_themselves():
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for weights in ("fp32", "bf16"):
        cfg = config(SHAPE + [f"memory.master_weights={str(weights == 'bf16').lower()}"])
        torch.manual_seed(0)
        model = hf_llama(cfg.model, torch.device("cpu"))
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        step, (_, keep) = hf_step(model, cfg, torch.device("cpu"), accum=2)
        losses = [step(x, x) for _ in range(3)]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (weights, losses)
        params = list(model.parameters())
        assert {p.dtype for p in params} == {torch.bfloat16 if weights == "bf16" else torch.float32}
        assert all(not torch.equal(p.float(), before[n]) for n, p in model.named_parameters())
        if weights == "bf16":  # the weights are the masters rounded, the masters fp32 and stepped
            assert all(m.dtype == torch.float32 for m in keep.masters)
            assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, keep.masters))
            assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in keep.masters)
        else:
            assert isinstance(keep, torch.optim.AdamW)


def test_the_gpt2_peer_has_teratrain_gpt2s_shape():
    """bench/train_step.py --model gpt2-*: transformers' GPT-2 built from the keys teratrain exports holds as many
    parameters as teratrain's (tied head, biases, learned positions; its q, k, v one matrix) and trains."""
    from common import hf_gpt2

    from teratrain.models.transformer import build_model

    cfg = config(["model.preset=gpt2-124m", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                  "model.vocab_size=61", "model.seq_len=16", "memory.precision=bf16", "train.grad_clip=1.0",
                  "optim.lr=1e-2", "train.device=cpu"])
    peer = hf_gpt2(cfg.model, torch.device("cpu"))
    ours = build_model(cfg.model, torch.device("cpu"), seed=0)
    assert peer.config.tie_word_embeddings and peer.config._attn_implementation == "sdpa"
    assert sum(p.numel() for p in peer.parameters()) == sum(p.numel() for p in ours.parameters())
    step, _ = hf_step(peer, cfg, torch.device("cpu"))
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [step(x, x) for _ in range(3)]
    assert losses[-1] < losses[0], losses
