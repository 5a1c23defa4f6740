"""The checkpoint index and the one reader of logical tensors.

`index.json` (written by rank 0 beside the rank files, covered by meta.json's digests) lists, per
logical tensor (`param/<name>`, `optim.exp_avg/<name>`, ...), its global shape and dtype and every
piece on disk: file, safetensors key, box offsets and shape, flat range (pieces.py). Pieces held by
several ranks (replicas) are written once.

`Reader.plan(entry)` finds the stored pieces a wanted piece overlaps and checks that they cover it
exactly (a gap or a key missing from its file is a CheckpointError naming the tensor); `Reader.run`
then copies the overlaps with safetensors `get_slice`: a piece stored whole (shaped like its box) is
sliced in every dim, so only the wanted elements are read; a flat piece (a ZeRO shard) is read as
the rows of its sub-box that hold them. Nothing else of the file is touched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from teratrain.checkpoint.format import DTYPES_BY_NAME, FORMAT, INDEX, CheckpointError
from teratrain.checkpoint.holdings import Entry
from teratrain.checkpoint.pieces import Piece, overlap, region_view


@dataclass
class Stored:
    file: str
    key: str
    piece: Piece
    replica: int | None


@dataclass
class Copy:
    stored: Stored
    src: tuple  # the stored piece's sub-box (global start, shape, flat offset) holding the region
    dst: tuple  # the wanted piece's sub-box receiving it
    region: tuple  # (start, stop) in global coordinates


class Index:
    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir)
        try:
            raw = json.loads((self.dir / INDEX).read_text())
            assert raw.get("format") == FORMAT
            self.tensors: dict[str, dict] = raw["tensors"]
            self.scalars: dict = raw.get("scalars", {})
            self.by_name: dict[str, list[str]] = {}
            for t in self.tensors.values():
                self.by_name.setdefault(t["name"], []).append(t["kind"])
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise CheckpointError(f"{self.dir.name}: {INDEX} is missing or unreadable ({type(e).__name__}); it is "
                                  "not a logical checkpoint of this teratrain version.") from None

    def names(self, kind: str) -> list[str]:
        return [t["name"] for t in self.tensors.values() if t["kind"] == kind]

    def kinds_of(self, name: str, prefix: str) -> list[str]:
        """The logical tensors (kinds) saved for parameter `name` whose kind starts with `prefix`."""
        return [k for k in self.by_name.get(name, ()) if k.startswith(prefix)]

    def info(self, kind: str, name: str) -> dict | None:
        return self.tensors.get(f"{kind}/{name}")

    def stored(self, kind: str, name: str, replica: int | None = None) -> list[Stored]:
        t = self.info(kind, name)
        if t is None:
            return []
        wanted = {None, 0 if replica is None else replica}  # shared pieces, and this replica's (readers: the first)
        return [Stored(p["file"], p["key"], Piece.from_json(name, t["shape"], p), p["replica"])
                for p in t["pieces"] if p["replica"] in wanted]

    def why_missing(self, name: str) -> str:
        """Why a checkpoint lacks a parameter: another model, or experts saved one parameter per expert."""
        stack, _, leaf = name.rpartition(".experts.")
        one = f"{stack}.experts.0.w{leaf[1:]}.{'weight' if leaf.startswith('w') else 'bias'}"
        if stack and one in self.by_name:
            return (f"it holds each expert as its own parameter ({one}), as teratrain saved experts before it "
                    "stacked them; where Hugging Face has the model's kind, export it with the teratrain that wrote "
                    "it (teratrain export) and start from that folder (model.init_from).")
        return "it was written for another model."

    def dtype(self, kind: str, name: str) -> torch.dtype:
        return DTYPES_BY_NAME[self.info(kind, name)["dtype"]]


class Reader:
    """Fills pieces from a checkpoint; keeps the files it opened until `close()`."""

    def __init__(self, index: Index):
        self.index, self._files = index, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._files.clear()

    def _open(self, file: str):
        if file not in self._files:
            try:
                self._files[file] = safe_open(str(self.index.dir / file), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{self.index.dir.name}: {file} is unreadable ({str(e)[:80]}).") from None
        return self._files[file]

    def plan(self, e: Entry) -> list[Copy]:
        """The copies that fill `e` from the stored pieces; CheckpointError unless they cover it exactly."""
        want, copies, covered = e.piece, [], 0
        info = self.index.info(e.kind, want.name)
        if info is None:
            raise CheckpointError(f"{self.index.dir.name} has no {e.logical}; " + self.index.why_missing(want.name))
        if tuple(info["shape"]) != want.shape:
            raise CheckpointError(f"{self.index.dir.name}: {e.logical} has shape {info['shape']}, this run needs "
                                  f"{list(want.shape)}.")
        wanted = want.sub_boxes()
        for s in self.index.stored(e.kind, want.name, e.replica):
            found = [Copy(s, src, dst, region) for dst in wanted for src in s.piece.sub_boxes()
                     if (region := overlap(dst[0], dst[1], src[0], src[1], want.shape))]
            if found:  # only the files this rank reads are opened and checked
                self._check_key(s, e)
            copies += found
            covered += sum(math.prod(b - a for a, b in zip(*c.region)) for c in found)
        if covered != want.in_bounds():
            raise CheckpointError(f"{self.index.dir.name}: the index covers {covered} of the {want.in_bounds()} "
                                  f"elements of {e.logical} this rank needs (a wrong or partial index).")
        return copies

    def _check_key(self, s: Stored, e: Entry) -> None:
        f = self._open(s.file)
        try:
            shape = f.get_slice(s.key).get_shape()
        except Exception:  # noqa: BLE001
            raise CheckpointError(f"{self.index.dir.name}: {s.file} lacks {s.key} named by the index.") from None
        stored_shape = list(s.piece.box) if s.piece.is_box() else [s.piece.numel]
        if list(shape) != stored_shape:
            raise CheckpointError(f"{self.index.dir.name}: {s.key} in {s.file} has shape {list(shape)}, the index "
                                  f"says {stored_shape}.")

    def run(self, copies: list[Copy], target: torch.Tensor) -> None:
        """Copy the planned overlaps into `target`, the flat data of the wanted piece."""
        flat = target.view(-1)
        for c in copies:
            region_view(flat, c.dst, c.region).copy_(self._region(c))

    def _region(self, c: Copy) -> torch.Tensor:
        """The region's values from the stored piece, reading no more than the rows holding them."""
        s = c.stored
        lo, hi = c.region
        sl = self._open(s.file).get_slice(s.key)
        if not lo:  # a 0-d tensor
            return self._open(s.file).get_tensor(s.key)
        if s.piece.is_box():  # stored shaped like its box: slice every dim
            return sl[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s.piece.offsets))]
        start, shape, off = c.src  # a sub-box of a flat piece: the rows of dim 0 that hold the region
        inner = math.prod(shape[1:])
        first, last = lo[0] - start[0], hi[0] - start[0]
        rows = sl[off + first * inner:off + last * inner].view(last - first, *shape[1:])
        return rows[(slice(None),) + tuple(slice(a - s0, b - s0) for a, b, s0 in zip(lo[1:], hi[1:], start[1:]))]

    def fill(self, e: Entry) -> None:
        self.run(self.plan(e), e.tensor)

    def read(self, kind: str, name: str, replica: int | None = None, row: int | None = None) -> torch.Tensor:
        """One whole logical tensor (generate, export), or its `row` of dim 0 (one expert of a stack):
        memory for that only."""
        info = self.index.info(kind, name)
        if info is None:
            raise CheckpointError(f"{self.index.dir.name} has no {kind}/{name}; " + self.index.why_missing(name))
        shape = tuple(info["shape"])
        piece = Piece.whole_of(name, shape)
        if row is not None:
            box = (1, *shape[1:])
            piece = Piece(name, shape, (row,) + (0,) * (len(shape) - 1), box, 0, math.prod(box))
        out = torch.zeros(piece.box, dtype=DTYPES_BY_NAME[info["dtype"]])
        self.fill(Entry(kind, piece, out, replica))
        return out if row is None else out[0]
