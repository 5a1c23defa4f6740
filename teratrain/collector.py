"""Python's garbage collector during training.

CPython's cyclic collector runs its oldest generation over every tracked object the process holds
once enough objects have survived the younger ones. A training process holds hundreds of thousands
(torch's modules and functions, the model's modules and parameters, the config), so each such
collection stops the host for 100-180 ms (a 32-block model's last pipeline stage: 312k objects and
154 ms on the CPU this repo is tested on, 282-297k objects and 134-175 ms on an H200's host). Where
the host paces the step (tensor parallelism's small kernels, a split backward's graph walk) the GPU
idles that long, and on a different step on each rank, so every rank waits for the slowest at the next
collective.

`Collector` freezes what exists when training starts (gc.freeze: the collector never visits those
objects again, and they live the whole run anyway) and again after the first step (the optimizer's
state, compiled code); a collection then visits only what the steps make (0.75 ms instead of 154 ms
on the model above). Each freeze collects first, so garbage is never frozen; an object alive at a
freeze that later becomes garbage in a reference cycle stays until training ends (bounded: only what
was alive then, never what later steps make). With `every` > 0 automatic collection is off and every
rank collects at the same steps (Megatron-LM's manual GC, torchtitan's gc_freq); reference cycles,
and any GPU memory they hold, then live until the next of those steps.

At its end a Collector unfreezes, unless it runs inside another Collector, whose run goes on. Python
releases frozen objects only all at once (gc.unfreeze), so whatever the process froze before (a
pre-fork gc.freeze, say) becomes collectable again too: that frees only what nothing uses. Python 3.12
counts its own immortal objects as frozen (375 at start; a full collection parks them in the permanent
generation), so a rule that unfroze only when nothing was frozen at the start would never unfreeze
there, and would keep every finished run's model (its reference cycles frozen) alive: benchmarks,
tests and notebooks that train several times in one process run out of memory that way
(tests/unit/test_collector.py).
"""

from __future__ import annotations

import gc
import threading

_running = [0]  # Collectors inside one another now
_lock = threading.Lock()


class Collector:
    """`with Collector(every) as gc_: ... gc_.step()` around a training loop (see the module)."""

    def __init__(self, every: int = 0):
        self.every, self.steps, self._was_enabled, self._entered = every, 0, True, False

    def __enter__(self) -> Collector:
        if self._entered:
            raise RuntimeError("a Collector runs one training loop at a time; make another for a nested loop")
        _freeze()  # before counting itself: a freeze interrupted here (Ctrl-C) leaves nothing to undo
        with _lock:
            _running[0] += 1
        self._was_enabled, self._entered = gc.isenabled(), True
        if self.every:
            gc.disable()
        return self

    def step(self, done: int | None = None) -> None:
        """After an optimizer step, on every rank alike: `done` is its number (1-based; a resumed run
        passes its own, so the collections fall on the same steps), else the steps counted here."""
        self.steps += 1
        done = self.steps if done is None else done
        if self.steps == 1:  # what the first step built for good (optimizer state, compiled code)
            _freeze()
        elif self.every and done % self.every == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        self._entered = False
        with _lock:
            _running[0] -= 1
            last = not _running[0]
        if self._was_enabled:
            gc.enable()
        if last:
            gc.unfreeze()  # the run's objects can be collected again once it ends (benchmarks, tests, notebooks)


def _freeze() -> None:
    """Collect first: garbage frozen in a cycle would never be freed."""
    gc.collect()
    gc.freeze()
