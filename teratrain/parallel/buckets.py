"""Gradient buckets and the one order every rank launches them in, for every engine (and the
planner, which counts the engines' buckets with the same rule).

Fixed order. Every rank launches its buckets' collectives in the same order, whatever gradients
happen to exist: bucket i is launched once it is complete and buckets 0..i-1 have been launched;
whatever is still incomplete when backward ends (a parameter unused on this rank this step) is
launched then, in order, with zeros for the missing gradients. Buckets are ordered by when backward
is expected to complete them (reverse registration order), so in the usual case nothing waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Bucket:
    """Parameters that share a reduction group and dtype, reduced by one collective."""

    key: tuple  # (group name, dtype, ...): what the bucket's members share
    members: list[tuple[str, object]] = field(default_factory=list)  # (name, parameter)
    nbytes: int = 0

    @property
    def group(self) -> str:
        return self.key[0]


def ordered_buckets(named, bucket_bytes: float, key, itemsize=None) -> list[Bucket]:
    """Greedy buckets of ~`bucket_bytes` per `key(param)`, in reverse registration order (about the
    order backward produces gradients); the returned order is the launch order: a bucket takes its
    place when it closes. `itemsize(param)` gives the bytes per element that count (the dtype the
    engine will hold; default the parameter's own). `named` holds (name, param) pairs, or anything
    with `numel()` (the planner passes its own records, so engine and planner share this rule)."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for item in reversed(named):
        name, p = item if isinstance(item, tuple) else (getattr(item, "name", None), item)
        k = key(p)
        b = open_.setdefault(k, Bucket(k))
        b.members.append((name, p))
        b.nbytes += p.numel() * (itemsize(p) if itemsize else p.element_size())
        if b.nbytes >= bucket_bytes:
            done.append(open_.pop(k))
    return done + list(open_.values())


class LaunchOrder:
    """Launch items (buckets or flat groups) strictly in list order, each once it is ready."""

    def __init__(self, items: list, launch):
        self.items, self.launch = items, launch
        self.ready = [False] * len(items)
        self.index = {id(x): i for i, x in enumerate(items)}
        self.next = 0

    def mark_ready(self, item) -> None:
        self.ready[self.index[id(item)]] = True
        while self.next < len(self.items) and self.ready[self.next]:
            self.launch(self.items[self.next])
            self.next += 1

    def flush(self) -> None:
        """Backward is over: launch every item not launched yet, in order; start afresh."""
        for item in self.items[self.next:]:
            self.launch(item)
        self.ready = [False] * len(self.items)
        self.next = 0
