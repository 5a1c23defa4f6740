"""Helpers shared by every tier: small configs and models, corrupting files on disk."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import torch

from teratrain.config import Config, ModelConfig, load_config, validate
from teratrain.models.transformer import Transformer, build_model

# A model small enough that a CLI run of ~50 steps takes a few seconds on 2 CPU cores.
TINY_SETS = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64",
             "train.global_batch=8", "train.micro_batch=4", "metrics.progress=false"]


PORT_BLOCK = 2000  # rendezvous ports of each pytest-xdist worker
_ports = itertools.count()


def free_port() -> int:
    """A free TCP port for a job's rendezvous (MASTER_PORT): below the kernel's ephemeral range (Linux: from
    32768), where no connection's own end is put (gloo's pairs and the store's clients take ephemeral ports),
    and in a block of PORT_BLOCK ports of its own for each pytest-xdist worker. So no other test, in this
    worker or the other, can take it between the moment it is picked here and the moment rank 0 listens
    on it (port 0's pick could be taken: EADDRINUSE, seen with the suite on 2 workers)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    base = 20000 + worker * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + next(_ports) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still closing from an earlier test
                continue
        return port
    raise RuntimeError(f"no free port in {base}-{base + PORT_BLOCK - 1} for this test worker")


def make_config(*overrides: str) -> Config:
    """A validated Config from `section.key=value` strings, as `--set` would give them."""
    return load_config(None, list(overrides))


def model_config(**keys) -> ModelConfig:
    """A ModelConfig for unit tests: a 2-block, width-32 Llama with 50 tokens unless overridden
    (a key given as None is unset: its derived default applies, not the preset's value)."""
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50, seq_len=16)
    return validate({"model": {**base, **keys}}).model


def small_model(dtype: torch.dtype = torch.float64, seed: int = 0, **keys) -> Transformer:
    return build_model(model_config(**keys), dtype=dtype, seed=seed)


def one_rank_moe(kernel: str, **moe_keys):
    """An MoE layer (4 experts, softmax-topk, width 8) with random weights on one rank, an input x and an
    output weighting c for a loss (y * c).sum(), and the tensors to differentiate: (layer, x, c, [x, *params])."""
    from teratrain.models import moe

    cfg = model_config(d_model=8, n_heads=2, n_kv_heads=2, d_ff=12, bias=kernel == "grouped",
                       moe=dict(num_experts=4, router="softmax-topk", **moe_keys))
    m = moe.MoE(cfg, layer=0).train()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    m.kernel = kernel
    x = torch.randn(1, 10, 8, generator=g, requires_grad=True)
    c = torch.randn(1, 10, 8, generator=g)
    return m, x, c, [x] + list(m.parameters())


def expert_out(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of a stack (models/moe.py's Experts) on rows x, written out: SwiGLU
    (silu(x w1_e^T + b1_e) * (x w3_e^T + b3_e)) w2_e^T + b2_e, or GELU's without w3; no dropout."""
    def lin(w, b, h):
        return h @ w[e].t() + (b[e] if b is not None else 0)

    h = lin(experts.w1, experts.b1, x)
    if experts.w3 is not None:
        h = torch.nn.functional.silu(h) * lin(experts.w3, experts.b3, x)
    else:
        h = torch.nn.functional.gelu(h, approximate="tanh")
    return lin(experts.w2, experts.b2, h)


def truncate(path: Path, keep_fraction: float = 0.5) -> None:
    """Cut a file short, as a crash in the middle of a write would."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep_fraction)])


def flip_byte(path: Path, offset: int = -1) -> None:
    """Invert one byte in place (same size): silent corruption that only a digest catches."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
