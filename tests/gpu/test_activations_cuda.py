"""What autograd keeps on the GPU against the planner's CUDA count (planner/activations.py, device="cuda"),
as tests/unit/test_planner_activations.py checks it on CPU: one forward (+ loss) of our model, shared storages
counted once, parameters excluded; bf16 autocast over fp32 parameters and bf16 parameters with fp32 masters,
llama and gpt2. Tolerance 5%, as on CPU. The norms in the residual stream's dtype (models/layers.py): under
bf16 parameters each keeps its bf16 input and fp32 statistics, and its output equals the fp32 computation's
rounded once (forward and input gradient within one bf16 step, 2^-7 relative)."""

import pytest
import torch

from teratrain.config import load_config
from teratrain.measure import build_engine, random_batch, saved_bytes
from teratrain.models.layers import LayerNorm, RMSNorm
from teratrain.planner.activations import forward_saved
from teratrain.planner.layout import ModelShape, widths


def _cfg(arch: str, masters: bool):
    sets = [f"model.arch={arch}", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=512",
            "model.vocab_size=512", "model.seq_len=128", "model.n_layers=2", "model.dropout=0.0",
            "memory.precision=bf16", "memory.recompute=none", "train.device=cuda"]
    sets += ["memory.master_weights=true"] if masters else []
    sets += ["model.tie_embeddings=true"] if arch == "gpt2" else []
    return load_config(None, sets)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_saved_bytes_match_the_planners_cuda_count(arch, masters):
    cfg = _cfg(arch, masters)
    model, _ = build_engine(cfg, "cuda")
    x, y = random_batch(cfg, 2, "cuda")
    measured = saved_bytes(model, x, y, "bf16")
    T = cfg.model.seq_len
    planned = forward_saved(ModelShape(cfg=cfg.model), widths("bf16", cfg.use_master_weights), 2 * T, T, "none", 1,
                            device="cuda", dropout=0.0)
    assert planned == pytest.approx(measured, rel=0.05), (planned, measured)


def _kept(fn, *args) -> int:
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.gpu(1)
@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm])
def test_norms_keep_their_bf16_input_and_round_once(norm):
    rows, d = 4096, 1024
    layer = (norm(d, 1e-5) if norm is RMSNorm else norm(d, 1e-5, True)).cuda()
    torch.nn.init.uniform_(layer.weight, 0.5, 1.5)
    if norm is LayerNorm:
        torch.nn.init.uniform_(layer.bias, -0.5, 0.5)
    ref = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.bfloat16()
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stats = 1 if norm is RMSNorm else 2  # rstd; mean and rstd
    with torch.autocast("cuda", dtype=torch.bfloat16):
        kept = _kept(layer, x)
        y = layer(x)
    params = sum(p.untyped_storage().nbytes() for p in layer.parameters())
    assert kept - params <= rows * d * 2 + stats * rows * 4, kept
    xf = x.detach().float().requires_grad_()
    args = [ref["weight"].bfloat16().float()] + ([ref["bias"].bfloat16().float()] if norm is LayerNorm else [])
    yf = (torch.nn.functional.rms_norm(xf, (d,), args[0], 1e-5) if norm is RMSNorm
          else torch.nn.functional.layer_norm(xf, (d,), *args, 1e-5))
    g = torch.randn_like(yf)
    y.backward(g.bfloat16())
    yf.backward(g)
    assert y.dtype == torch.bfloat16
    assert float((y.detach().float() - yf).abs().max() / yf.abs().max()) <= 2 ** -7
    assert float((x.grad.float() - xf.grad).abs().max() / xf.grad.abs().max()) <= 2 ** -7
