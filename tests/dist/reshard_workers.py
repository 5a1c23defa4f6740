"""Bodies for the resharding tests (module-level so spawned ranks can import them): train on fixed
random tokens with the engines (layout_workers.py), save logical checkpoints, resume them at
another layout."""

from __future__ import annotations

from pathlib import Path

import torch

from layout_workers import build, train_steps
from teratrain.checkpoint.training import restore_training, save_training

CONSTANT = ["optim.schedule=constant", "checkpoint.keep=5"]


def job(rank: int, world: int, overrides: list[str], steps: int, save_to: str | None = None,
        resume_from: str | None = None, save_first: str | None = None) -> list[float]:
    """Resume from `resume_from` (any layout) if given, optionally save at once to `save_first` (the
    save -> load -> save round trip), train until `steps`, then save to `save_to`. Returns the
    losses of the steps trained here."""
    cfg, rt, model, engine = build(CONSTANT + overrides)
    start = restore_training(Path(resume_from) / "checkpoints", cfg, rt, engine, Path(resume_from)) if resume_from else 0
    if save_first:
        save_training(Path(save_first) / "checkpoints", start, cfg, rt, engine)
    losses = train_steps(cfg, rt, model, engine, steps, start)
    if save_to:
        save_training(Path(save_to) / "checkpoints", steps, cfg, rt, engine)
    return losses


def jobs(rank: int, world: int, todo: list[dict]) -> list[list[float]]:
    """Several jobs in one set of processes (process start-up dominates tiny runs)."""
    return [job(rank, world, **kw) for kw in todo]


def logical_tensors(run: str | Path) -> dict[str, torch.Tensor]:
    """Every logical tensor (parameters and optimizer state) of the run's latest checkpoint, whole."""
    from teratrain.checkpoint.index import Index, Reader

    root = Path(run) / "checkpoints"
    with Reader(Index(root / (root / "latest").read_text().strip())) as reader:
        return {key: reader.read(t["kind"], t["name"]) for key, t in reader.index.tensors.items()}
