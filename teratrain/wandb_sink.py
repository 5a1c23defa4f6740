"""Weights & Biases as one more place metrics go (metrics.wandb), beside metrics.jsonl and TensorBoard.

Rank 0 logs every metrics.jsonl record's numbers at its step (a save's blocked and write seconds as
`checkpoint_block_s`, `checkpoint_write_s`), with the resolved config. The W&B run's id is derived
from the run directory, so a resumed run continues the same W&B run. `metrics.wandb_mode=auto` logs
online where an API key is configured (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc) and
offline otherwise, into <run>/wandb (`wandb sync` uploads it later): nothing is sent without a key,
and nothing probes the network. wandb is an optional dependency (`pip install wandb`).
"""

from __future__ import annotations

import hashlib
import importlib
import netrc
import os
from pathlib import Path

from teratrain.config_base import ConfigError


def check(cfg) -> None:
    """Refuse metrics.wandb without the wandb package, before anything starts."""
    if not cfg.metrics.wandb:
        return
    try:
        importlib.import_module("wandb")
    except ImportError:
        raise ConfigError("metrics.wandb needs the wandb package; install it with pip install wandb, or set "
                          "metrics.wandb=false.") from None


def mode(setting: str) -> str:
    """online or offline: as set, or (auto) online only where an API key is configured."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbSink:
    """Logs records to a W&B run, started at the first record (a run that fails before its first
    step leaves no W&B run)."""

    def __init__(self, run_dir: Path, cfg, resume: bool):
        self.run_dir, self.cfg, self.resume, self.run = run_dir, cfg, resume, None

    def _start(self) -> None:
        import wandb

        m = self.cfg.metrics
        run_id = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=m.wandb_project, name=self.run_dir.name, id=run_id, dir=str(self.run_dir),
                              mode=mode(m.wandb_mode), config=self.cfg.model_dump(),
                              resume="allow" if self.resume else None,
                              settings=wandb.Settings(console="off"))  # stdout and stderr stay teratrain's

    def log(self, record: dict) -> None:
        if self.run is None:
            self._start()
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for save in record.get("checkpoints", []):
            numbers.update(checkpoint_block_s=save["block_s"], checkpoint_write_s=save["write_s"])
        self.run.log(numbers, step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
