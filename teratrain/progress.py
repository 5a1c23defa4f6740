"""Progress of a run on stderr: a tqdm bar on a terminal; plain lines every `train.log_every` steps
otherwise (a batch job's log file would fill with carriage-return redraws)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, enabled: bool, log_every: int, stream=None):
        self.total, self.log_every, self.enabled = total, log_every, enabled
        self.stream = stream or sys.stderr
        self.t0, self.start = time.perf_counter(), start
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=self.stream)

    def step(self, done: int, loss: float, tokens_per_s: float, lr: float, eval_loss: float | None = None) -> None:
        """Optimizer step `done` (1-based) finished with this loss and throughput."""
        if not self.enabled:
            return
        due = done % self.log_every == 0 or done == self.total
        if self.bar is not None:
            if due:
                self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif due:
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / (done - self.start) * (self.total - done)
            ev = f" | eval {eval_loss:.4f}" if eval_loss is not None else ""
            print(f"step {done}/{self.total} | loss {loss:.4f}{ev} | lr {lr:.3g} | {tokens_per_s:,.0f} tokens/s | "
                  f"elapsed {elapsed:,.0f} s, eta {eta:,.0f} s", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
