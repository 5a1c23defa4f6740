"""What a run reports: tokens/s, MFU, memory, metrics.jsonl, TensorBoard, W&B, loss.png, progress bar."""

from __future__ import annotations

import importlib
import json
import resource
import sys
from pathlib import Path

import torch

from teratrain import wandb_sink
from teratrain.config_base import ConfigError

# Dense (no sparsity) peak TFLOP/s from vendor datasheets, by substring of the device name.
# bf16/fp16 on tensor cores; fp32 is plain (non-TF32) FP32.
# fp8: e4m3/e5m2 tensor cores (compute capability 8.9 and up), where the card has them.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2, "fp8": 1513.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6, "fp8": 733.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}


def peak_flops(device: torch.device, precision: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (CPUs, unlisted GPUs) and not overridden."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in GPU_PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100" on purpose
        if key in name and table.get(precision):
            return table[precision] * 1e12
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def check_sinks(cfg) -> None:
    """Refuse metrics.tensorboard or metrics.wandb without its package, before anything starts."""
    if cfg.metrics.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ConfigError("metrics.tensorboard needs the tensorboard package; install it with pip install "
                              "tensorboard, or set metrics.tensorboard=false.") from None
    wandb_sink.check(cfg)


class MetricsLog:
    """metrics.jsonl (one object per optimizer step, flushed) and optional TensorBoard events. Files are
    made at the first record, so a run that fails before its first step leaves none (rundir.remove_if_unused)."""

    def __init__(self, run_dir: Path, tensorboard: bool, append: bool, sinks: list = ()):
        self.run_dir, self.path = run_dir, run_dir / "metrics.jsonl"
        self.tensorboard, self.mode = tensorboard, "a" if append else "w"
        self.file = self.tb = None
        self.sinks = list(sinks)  # more places records go, each with log(record) and close() (wandb_sink.py)

    def _open(self) -> None:
        self.file = open(self.path, self.mode)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # present: train.py checked it (check_sinks)

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if self.file is None:
            self._open()
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, record["step"])
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, out: Path) -> None:
    """loss.png: training loss per step, eval loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    ev = [r for r in rows if r.get("eval_loss") is not None]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
