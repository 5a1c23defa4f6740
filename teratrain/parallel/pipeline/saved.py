"""What a split backward (ZB-H1's I, later W) keeps of a micro-batch's forward, and recomputation
that the split does not repeat.

autograd keeps every tensor a forward saved until the graph dies, and I retains the graph for W, so
a stage would hold all of a micro-batch's activations until its W. W only runs the weight halves
of the "intermediate" nodes (backward.py), which need only those nodes' own saved tensors (for
`x @ W.T`: x; Qi et al. 2023 sec. 2: W needs the layer input and the output gradient). `SplitSaved`
packs every tensor a forward saves into a holder (torch.autograd.graph.saved_tensors_hooks); while I
runs, a tensor unpacked by any other node is dropped right after (no later pass runs that node), so
from I to W the stage holds the intermediates' tensors only.

Recomputation (memory.recompute = full, every-k, sqrt): torch's checkpoint keys what it recomputes
by autograd graph task, and W reads the intermediates' saved inputs outside I's task, so W would
replay the segments' forwards again (measured on a 4-block Llama chunk when W made one autograd call
per weight group: I + W = 3.4 x B's FLOPs). Here a
segment (`SplitSaved.segment`) saves nothing in the forward; on its first unpack its forward is
replayed once from its detached inputs, with the forward's RNG and autocast state (Chen et al. 2016),
and the replayed tensors are dropped as above. I + W then replay each segment once, as B does.
"""

from __future__ import annotations

import contextlib

import torch


class _Replayed(Exception):
    """Raised from the replay's pack hook to stop it once every needed tensor is saved."""


class _Holder:
    """One saved tensor: held directly, or the `index`-th tensor its segment's replay saves."""

    __slots__ = ("tensor", "segment", "index")

    def __init__(self, tensor, segment, index):
        self.tensor, self.segment, self.index = tensor, segment, index

    def held(self) -> torch.Tensor | None:
        """The tensor if it is in memory now (never replays)."""
        if self.segment is None:
            return self.tensor
        return self.segment.tensors[self.index] if self.segment.tensors is not None else None


class _Segment:
    """A recomputed segment: fn(*args) and the state its forward ran with."""

    def __init__(self, fn, args: tuple):
        self.fn = fn
        self.args = [(a.detach(), a.requires_grad) if isinstance(a, torch.Tensor) else (a, None) for a in args]
        dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"), None)
        self.device = dev  # the RNG replayed besides the CPU's
        self.cpu_rng = torch.get_rng_state()
        self.dev_rng = torch.cuda.get_rng_state(dev) if dev is not None and dev.type == "cuda" else None
        kind = dev.type if dev is not None else "cpu"
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        self.count = 0  # tensors the forward saved
        self.tensors: list | None = None

    def tensor(self, index: int) -> torch.Tensor | None:
        if self.tensors is None:
            self.tensors = self._replay()
        return self.tensors[index]

    def replay_missing(self) -> None:
        """Replay again to restore dropped tensors (a node I ran is run again: kept tensors stay)."""
        fresh = self._replay()
        self.tensors = [t if t is not None else f for t, f in zip(self.tensors, fresh)]

    def _replay(self) -> list[torch.Tensor]:
        """The segment's forward again, stopped once it has saved what the forward saved (what follows
        the last saved tensor is not needed: torch's checkpoint stops there too)."""
        out: list[torch.Tensor] = []

        def keep(t):
            out.append(t.detach())
            if len(out) == self.count:
                raise _Replayed

        def never(_):
            raise RuntimeError("a recomputed pipeline segment unpacked a tensor while being replayed")

        inputs = [a.requires_grad_(g) if g is not None else a for a, g in
                  ((x.detach() if isinstance(x, torch.Tensor) else x, g) for x, g in self.args)]
        kind, enabled, dtype = self.autocast
        devices = [self.device] if self.dev_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.enable_grad(), \
                torch.autocast(kind, dtype=dtype, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(keep, never):
            torch.set_rng_state(self.cpu_rng)
            if self.dev_rng is not None:
                torch.cuda.set_rng_state(self.dev_rng, self.device)
            try:
                self.fn(*inputs)
            except _Replayed:
                pass
        if len(out) != self.count:
            raise RuntimeError(f"a recomputed pipeline segment saved {len(out)} tensors, its forward {self.count}: "
                               "the segment is not deterministic")
        return out


_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
                     "ExpandBackward0"})


def cast_key(t: torch.Tensor) -> tuple | None:
    """If `t` is (a view of) a copy of a parameter in another dtype (autocast's cast of a weight),
    a key naming that parameter, its version and the view; else None."""
    node = t.grad_fn
    while node is not None and node.name() in _VIEWS:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return None
    p = getattr(node.next_functions[0][0], "variable", None)  # an AccumulateGrad node's parameter
    if p is None or p.dtype == t.dtype or p.device != t.device:
        return None
    return id(p), p._version, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()


class SplitSaved:
    """The saved tensors of one micro-batch's forward on one chunk (use `recording()` around it).

    `casts`, shared by every micro-batch of one step: autocast casts the weights again in each
    micro-batch's forward, and each graph saves its own copy (a linear's backward keeps its weight),
    which a micro-batch waiting for W would hold although W (x^T dY) never reads it; ZB-H1's rank r
    holds r micro-batches waiting for W beside its pp - r in flight, so pp copies in all where 1F1B
    holds pp - r. The weights do not change within a flush step, so every micro-batch's holder
    takes the first micro-batch's copy (the same values) and its own is freed after its forward.
    """

    def __init__(self, casts: dict | None = None):
        self.holders: list[_Holder] = []
        self.casts = casts
        self._segment: _Segment | None = None
        self._keep: set | None = None  # during I: the nodes whose tensors W needs
        self._kept: dict = {}  # node -> the holders it unpacked during I and kept (release)

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def segment(self, fn, *args):
        """fn(*args) as a recomputed segment: its saved tensors are replayed when first needed."""
        outer, self._segment = self._segment, _Segment(fn, args)
        try:
            return fn(*args)
        finally:
            self._segment = outer

    @contextlib.contextmanager
    def dropping(self, keep: set):
        """While I runs: drop each tensor once unpacked, unless its node is in `keep`."""
        self._keep = keep
        try:
            yield
        finally:
            self._keep = None

    def release(self, nodes) -> None:
        """After I: drop what `nodes` (kept through I) saved, which no later pass runs, and forget
        which node kept what (the map references the graph, whose saved tensors reference this
        object through the unpack hook: a cycle through C++ that Python's collector cannot see)."""
        for node in nodes:
            for h in self._kept.pop(node, ()):
                if h.segment is None:
                    h.tensor = None
                elif h.segment.tensors is not None:
                    h.segment.tensors[h.index] = None
        self._kept = {}

    def held_bytes(self, exclude: frozenset = frozenset()) -> int:
        """Bytes of the distinct storages held (a tensor saved twice counts once), the recomputed
        segments' inputs included, leaving out the storages in `exclude` (data pointers: the
        parameters, which the model holds anyway)."""
        segments = {id(h.segment): h.segment for h in self.holders if h.segment is not None}.values()
        tensors = [a for seg in segments for a, grad in seg.args if grad is not None]
        tensors += [h.held() for h in self.holders]
        seen, total = set(exclude), 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    def _pack(self, t: torch.Tensor) -> _Holder:
        seg = self._segment
        if seg is None:  # detached: the holder must not keep the graph (and so itself) alive
            key = cast_key(t) if self.casts is not None else None
            if key is not None:
                t = self.casts.setdefault(key, t)
            h = _Holder(t.detach(), None, 0)
        else:
            h = _Holder(None, seg, seg.count)
            seg.count += 1
        self.holders.append(h)
        return h

    def _unpack(self, h: _Holder) -> torch.Tensor:
        if h.segment is None:
            t = h.tensor
        else:
            t = h.segment.tensor(h.index)
            if t is None:
                h.segment.replay_missing()
                t = h.segment.tensors[h.index]
        if t is None:
            raise RuntimeError("the split backward dropped a saved tensor after I that a later pass needs")
        node = torch._C._current_autograd_node() if self._keep is not None else None
        if node is not None and node in self._keep:
            self._kept.setdefault(node, []).append(h)
        elif self._keep is not None:
            if h.segment is None:
                h.tensor = None
            else:
                h.segment.tensors[h.index] = None
        return t
