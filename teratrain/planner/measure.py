"""Counting real runs: the numbers the planner's arithmetic is validated against.

The planner itself never runs a model; this module does, for tests/unit/test_planner_*.py (CPU) and
bench/planner_validate.py (GPU), building the model exactly as `teratrain train` does for one
process (meta device -> parallelize(): recompute, then materialization and the update engine).
"""

from __future__ import annotations

import torch

from teratrain.memory.precision import autocast
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer, lm_loss
from teratrain.parallel.parallelize import parallelize


def build_engine(cfg, device: str | torch.device = "cpu"):
    """Model and engine as `teratrain train` builds them for one process."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return model, parallelize(model, Runtime.single(device), cfg)


def saved_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> int:
    """Bytes of distinct storages autograd keeps from forward to backward for one micro-batch
    (loss included), parameters excluded (they are model states, counted elsewhere)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(precision, x.device):
            loss = lm_loss(model(x), y)
    del loss
    return sum(seen.values())


def random_batch(cfg, batch: int, device: str | torch.device = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), generator=g)
    return x.to(device), y.to(device)

