"""Counting real runs: the numbers the planner's arithmetic is validated against.

The planner itself never runs a model; this module does, for tests/unit/test_planner_*.py (CPU) and
bench/planner_validate.py (GPU), building the model exactly as `teratrain train` does for one
process (meta device -> parallelize(): recompute, then materialization and the update engine).
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from teratrain.memory.compression import ActivationCodec, compressed_saves, held_tensors
from teratrain.memory.precision import autocast
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer, lm_loss
from teratrain.parallel.parallelize import parallelize


def build_engine(cfg, device: str | torch.device = "cpu", rt: Runtime | None = None):
    """Model and engine as `teratrain train` builds them: for one process on `device`, or this rank of `rt`."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return model, parallelize(model, rt or Runtime.single(device), cfg)


def saved_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str,
                targets_in_model: bool = False, kept: list | None = None) -> int:
    """Bytes of distinct storages autograd keeps from forward to backward for one micro-batch
    (loss included), parameters excluded (they are model states, counted elsewhere). With activation
    compression (memory/compression.py), what its encoder returns is what is kept and counted.
    `targets_in_model`: the loss as training computes it, model(x, y) (a parallelized model's own
    criterion, e.g. the vocab-parallel loss), rather than lm_loss of the whole logits. `kept`: a list that gets
    (shape, dtype, bytes) of each storage counted, one entry a storage."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    codec = getattr(model, "activation_codec", None)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        packed = codec.pack(t) if codec is not None else t
        for held in held_tensors(packed):
            s = held.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in seen:
                seen[s.data_ptr()] = s.nbytes()
                if kept is not None:
                    kept.append((list(held.shape), str(held.dtype).removeprefix("torch."), s.nbytes()))
        # No backward follows this forward: a saved output returned as itself would hold its own
        # grad_fn in a reference cycle through C++ that never frees (the graph, params included).
        return packed.detach() if packed is t else packed

    model.train()
    with compressed_saves(model), torch.autograd.graph.saved_tensors_hooks(pack, ActivationCodec.unpack):
        with autocast(precision, x.device):  # the innermost hooks (the counter) are the ones autograd calls
            loss = model(x, y) if targets_in_model else lm_loss(model(x), y)
    del loss
    return sum(seen.values())


class LiveStorages(TorchDispatchMode):
    """Every storage an op makes while the mode is on, held weakly: what is still alive afterwards is
    what the forward left for backward, whoever keeps it: autograd's saved tensors, a checkpoint's
    inputs, and the outputs a selective checkpoint policy caches itself, which saved-tensor hooks never
    see (memory.recompute=selective-ops). A storage counts once, however many tensors view it."""

    def __init__(self):
        super().__init__()
        self._made: list[tuple[int, StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._made += _storages(out)
        return out

    def alive_bytes(self, exclude: set[int] = frozenset()) -> int:
        """Bytes of the storages made under the mode that are alive now, storages at `exclude` left out
        (garbage in reference cycles collected first, so what is counted does not depend on when
        Python's collector last ran)."""
        gc.collect()
        alive = {ptr: n for ptr, ref, n in self._made if not ref.expired() and ptr not in exclude}
        return sum(alive.values())


class PeakStorages(TorchDispatchMode):
    """The most bytes alive at once, after any op run while the mode is on, of the storages those ops made
    (each storage once, however many tensors view it; storages made before the mode left out): on CPU, the
    peak torch.cuda.max_memory_allocated measures on a GPU, less the allocator's rounding and caches."""

    def __init__(self):
        super().__init__()
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}  # address -> the storage last seen there
        self._total = 0  # bytes of every entry of _alive, those whose storage has expired since included
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, ref, n in _storages(out):
            held = self._alive.get(ptr)
            self._total += n - (held[1] if held is not None else 0)
            self._alive[ptr] = (ref, n)
        # the live bytes are at most the running total, so the peak can rise only where the total tops it: only
        # then are the expired entries dropped (a storage once expired stays so) and the live bytes compared
        if self._total > self.peak:
            for ptr in [ptr for ptr, (ref, _) in self._alive.items() if ref.expired()]:
                self._total -= self._alive.pop(ptr)[1]
            self.peak = max(self.peak, self._total)
        return out


def _storages(out) -> list[tuple[int, StorageWeakRef, int]]:
    """(address, weak reference, bytes) of the storage of each tensor an op returned."""
    return [(s.data_ptr(), StorageWeakRef(s), s.nbytes())
            for t in tree_leaves(out) if isinstance(t, torch.Tensor) for s in [t.untyped_storage()]]


def live_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> int:
    """Bytes one training forward (model(x, y), the loss included) leaves alive for its backward,
    parameters excluded, as `LiveStorages` counts them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.train()
    with autocast(precision, x.device), LiveStorages() as made:
        loss = model(x, y)
    held = made.alive_bytes(params)
    del loss
    return held


def random_batch(cfg, batch: int, device: str | torch.device = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), generator=g)
    return x.to(device), y.to(device)

