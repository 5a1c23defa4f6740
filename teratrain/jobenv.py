"""Who started this process, read from the environment its launcher set: `teratrain train --nproc`
(launch.py: LAUNCHER_ENV) or plain torchrun (TORCHELASTIC_*), and how often torchrun restarted it. A leaf
module: the launcher, the run directory and the hang watch all read it."""

from __future__ import annotations

import os
from pathlib import Path

LAUNCHER_ENV = "TERATRAIN_LAUNCHER_PID"
run_dir: Path | None = None  # the run directory this process's ranks agreed on (rundir.agree_run_dir sets it): its error.log


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def under_launcher() -> bool:
    """True in a rank started by `teratrain train --nproc` (the launcher owns the run directory)."""
    return LAUNCHER_ENV in os.environ and "WORLD_SIZE" in os.environ


def under_torchrun() -> bool:
    """True in a rank started by plain torchrun (not by `teratrain train --nproc`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ and not under_launcher()


def restarts() -> tuple[int, int]:
    """(torchrun's --max-restarts, the restarts after a failure so far) of this rank's job; (0, 0)
    outside plain torchrun. A restart for a node joining or leaving counts as none."""
    if not under_torchrun():
        return 0, 0
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
