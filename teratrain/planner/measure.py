"""Counting real runs: the numbers the planner's arithmetic is validated against.

The planner itself never runs a model; this module does, for tests/unit/test_planner_*.py (CPU) and
bench/planner_validate.py (GPU). It builds the model exactly as training does (build_model ->
apply_recompute -> LocalEngine, which casts parameters to low precision when fp32 masters are kept).
"""

from __future__ import annotations

import torch

from teratrain.memory.precision import autocast
from teratrain.memory.recompute import apply_recompute
from teratrain.models.transformer import build_model, lm_loss
from teratrain.optim.engine import LocalEngine


def build_engine(cfg, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, LocalEngine]:
    """Model and single-replica engine as `teratrain train` builds them for one process."""
    model = build_model(cfg.model, device, seed=cfg.train.seed)
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every)
    engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
    return model, engine


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


def train_step(model, engine: LocalEngine, batches, precision: str, lr: float = 1e-4) -> None:
    """One optimizer step over `batches` (micro-batches accumulated), as train.py runs it."""
    for i, (x, y) in enumerate(batches):
        with engine.accumulate(last=i == len(batches) - 1):
            with autocast(precision, x.device):
                loss = lm_loss(model(x), y)
            engine.backward(loss / len(batches))
    engine.step(lr)
