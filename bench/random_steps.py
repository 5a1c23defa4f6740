"""Training on fixed random tokens inside one torchrun job, for the several-GPU benchmarks
(multi_gpu.py, reshard.py): every layout sees the same global batch at every step, so any layout
compares with any other (one GPU accumulating the micro-batches that N GPUs split), and several
layouts run one after another in the same processes (process start-up dominates short runs).

Each step's global batch (train.global_batch, seq_len + 1) comes from a generator seeded by the step
alone; data-parallel rank r takes rows [r*B/dp, (r+1)*B/dp) and splits them into micro-batches of
train.micro_batch. The reported loss is the mean over data-parallel ranks.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from teratrain.config import load_config
from teratrain.mesh import init_runtime
from teratrain.models.transformer import Transformer
from teratrain.optim.engine import train_step
from teratrain.parallel.comm import AVG, all_reduce
from teratrain.parallel.parallelize import parallelize
from teratrain.train import seed_everything


class Run:
    """One layout's model and engine in this process."""

    def __init__(self, sets: list[str]):
        release_memory()
        self.cfg = load_config(None, sets)
        self.rt = init_runtime(self.cfg)
        self.cfg.parallel.dp = self.rt.dims.dp
        seed_everything(self.cfg.train.seed + self.rt.dp_rank)
        if self.rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        with torch.device("meta"):
            self.model = Transformer(self.cfg.model)
        self.engine = parallelize(self.model, self.rt, self.cfg)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tc, rt = self.cfg.train, self.rt
        g = torch.Generator().manual_seed(1000 + step)  # the step's global batch, the same on every layout
        batch = torch.randint(0, self.cfg.model.vocab_size, (tc.global_batch, self.cfg.model.seq_len + 1), generator=g)
        per_rank = tc.global_batch // rt.dims.dp
        rows = batch[rt.dp_rank * per_rank:(rt.dp_rank + 1) * per_rank].to(rt.device)
        return [(rows[i:i + tc.micro_batch, :-1], rows[i:i + tc.micro_batch, 1:])
                for i in range(0, per_rank, tc.micro_batch)]

    def steps(self, first: int, count: int) -> dict:
        """Steps first..first+count-1: each one's mean loss and wall time (synchronized)."""
        losses, times = [], []
        for step in range(first, first + count):
            micro = self.micro_batches(step)
            self.sync()
            t0 = time.perf_counter()
            _, loss = train_step(self.model, self.engine, micro, self.cfg.memory.precision, self.cfg.optim.lr)
            loss = loss.detach().clone()
            all_reduce(loss, self.rt.dp_group, op=AVG)
            losses.append(float(loss))  # also waits for the step
            self.sync()
            times.append(time.perf_counter() - t0)
        return {"losses": losses, "step_s": times}

    def sync(self) -> None:
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)
        self.rt.barrier()

    def summary(self, result: dict, skip: int = 3) -> dict:
        """Tokens/s over the whole job (median step after `skip` warm-up steps), peak memory (max over
        ranks) and the model states this rank counted."""
        step_s = statistics.median(result["step_s"][skip:] or result["step_s"])
        tokens = self.cfg.train.global_batch * self.cfg.model.seq_len
        peak = torch.tensor([float(torch.cuda.max_memory_allocated(self.rt.device)) if self.rt.device.type == "cuda"
                             else 0.0], device=self.rt.device)
        if self.rt.world > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        return {"tokens_per_s": tokens / step_s, "step_ms": 1e3 * step_s, "peak_gib": float(peak) / 2**30,
                "model_state_bytes": self.engine.last_state_bytes, "gpus": self.rt.world, **result}

    def close(self) -> None:
        del self.model, self.engine
        release_memory()


def release_memory() -> None:
    """Free the previous layout's tensors (engines and models hold reference cycles) and cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
