"""What autograd keeps on the GPU against the planner's CUDA count (planner/activations.py, device="cuda"),
as tests/unit/test_planner_activations.py checks it on CPU: one forward (+ loss) of our model, shared storages
counted once, parameters excluded; bf16 autocast over fp32 parameters and bf16 parameters with fp32 masters,
llama and gpt2 (the kernels that differ from the CPU's: fused RMSNorm, fp32 LayerNorm under CUDA autocast,
cuDNN/flash attention). Tolerance 5%, as on CPU."""

import pytest

from teratrain.config import load_config
from teratrain.measure import build_engine, random_batch, saved_bytes
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
