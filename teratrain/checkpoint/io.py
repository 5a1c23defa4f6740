"""Checkpoint directories on disk.

    <run>/checkpoints/step_00000016/
        rank00000.safetensors   the pieces of logical tensors rank 0 holds (parameters, fp32 masters,
                                optimizer moments: checkpoint/holdings.py) and its RNG state
        rank00000.json          JSON state of rank 0 (its pieces, loss scaler, RNG, data position)
        index.json              every logical tensor's global shape and pieces (checkpoint/index.py)
        meta.json               written last: step, world size, layout, size + sha256 of every file
    <run>/checkpoints/latest    name of the newest complete checkpoint

A checkpoint is written into `step_X.tmp/`, every file fsynced, then renamed to `step_X/`, and only
after that is `latest` replaced (itself atomically). The folder must be on a filesystem every rank
sees (as multi-node torchrun jobs have): ranks agree on which checkpoint to resume from by checking
the same files. A crash leaves at worst a `.tmp` folder that is
ignored. On load, a checkpoint whose files are missing, truncated or fail their digest is skipped
with a warning and the previous complete one is used. Each file's digest is checked by one rank of
the job reading it (old rank k's files by new rank k mod world), so every file is checked once
whatever the layout that resumes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from teratrain.checkpoint.format import DTYPE_NAMES, FORMAT, INDEX, CheckpointError, merge_rank
from teratrain.fsio import atomic_write_bytes, fsync_dir, fsync_file
from teratrain.fsio import sha256_file as sha256


def _noop(*_):
    return None


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Stream tensors into a safetensors file one at a time (no second copy of the state in memory;
    views of one flat buffer are fine, unlike `safetensors.torch.save_file`). Returns the file's
    sha256, computed from the bytes as they are written (no second read of a large file)."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in _chunks(blob, names, tensors):
            digest.update(chunk)
            f.write(chunk)
        f.flush()
    return digest.hexdigest()


def _chunks(blob: bytes, names: list[str], tensors: dict[str, torch.Tensor]):
    yield struct.pack("<Q", len(blob))
    yield blob
    for name in names:
        t = tensors[name].detach().contiguous().cpu()
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy()  # written and hashed in place: no copy as bytes


def save(root: Path, step: int, rank: int, world: int, tensors: dict[str, torch.Tensor], meta: dict,
         keep: int, global_meta: dict | None = None, barrier: Callable[[], None] = _noop) -> Path:
    """Write this rank's part of checkpoint `step`; rank 0 publishes it. Collective over ranks."""
    tmp = begin(root, step, rank, barrier)
    write_rank(root, tmp, rank, tensors, meta)
    barrier()
    if rank == 0:  # each rank hashed its own (large) file while writing it; only the JSONs are read here
        publish(root, step, world, keep, global_meta)
    barrier()
    return root / f"step_{step:08d}"


def begin(root: Path, step: int, rank: int, barrier: Callable[[], None] = _noop) -> Path:
    """Rank 0 makes the empty `step_X.tmp/` every rank writes into (collective); returns it."""
    name = f"step_{step:08d}"
    tmp = root / f"{name}.tmp"
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            raise _disk_full(root, name, e) from None
    barrier()
    return tmp


def write_rank(root: Path, tmp: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """This rank's tensor file and JSON state into `tmp`, fsynced (any thread may run it)."""
    try:
        st_path = tmp / f"rank{rank:05d}.safetensors"
        digest = write_safetensors(st_path, tensors)
        fsync_file(st_path)
        own = {"bytes": st_path.stat().st_size, "sha256": digest}
        atomic_write_bytes(tmp / f"rank{rank:05d}.json", json.dumps({**meta, "file": own}).encode())
    except OSError as e:  # a full disk, a quota: drop the partial folder (it would only fill the disk more)
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_full(root, tmp.name.removesuffix(".tmp"), e) from None


def publish(root: Path, step: int, world: int, keep: int, global_meta: dict | None = None) -> Path:
    """Rank 0, once every rank's files are in `step_X.tmp/`: meta.json, the rename to `step_X/`, then
    `latest`, then pruning. Returns the checkpoint folder."""
    name = f"step_{step:08d}"
    tmp, final = root / f"{name}.tmp", root / name
    files, index = {}, {}
    for r in range(world):
        rank_json = tmp / f"rank{r:05d}.json"
        rank_meta = json.loads(rank_json.read_text())
        files[f"rank{r:05d}.safetensors"] = rank_meta["file"]
        files[rank_json.name] = {"bytes": rank_json.stat().st_size, "sha256": sha256(rank_json)}
        merge_rank(index, rank_meta, f"rank{r:05d}.safetensors")
    if index.get("tensors"):
        atomic_write_bytes(tmp / INDEX, json.dumps({"format": FORMAT, **index}).encode())
        files[INDEX] = {"bytes": (tmp / INDEX).stat().st_size, "sha256": sha256(tmp / INDEX)}
    atomic_write_bytes(tmp / "meta.json", json.dumps({"step": step, "world": world, "files": files,
                                                      **(global_meta or {})}, indent=1).encode())
    if final.exists():  # the same step saved again (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    atomic_write_bytes(root / "latest", name.encode())
    _prune(root, keep, step)
    return final


def _disk_full(root: Path, name: str, e: OSError) -> CheckpointError:
    latest = root / "latest"
    if latest.is_file():
        then = (f"then continue with --resume: the last complete checkpoint ({latest.read_text().strip()}) is "
                "intact.")
    else:
        then = f"this run has no earlier checkpoint to resume, so delete {root.parent} and train it again."
    return CheckpointError(f"could not write checkpoint {name} in {root} ({e.strerror}); free space or raise the "
                           f"quota; {then}")


def _prune(root: Path, keep: int, current: int) -> None:
    """Keep the `keep` newest checkpoints up to `current`. Checkpoints of later steps belong to a run
    abandoned by a resume (e.g. one that fell back past a corrupt checkpoint): drop them, so the one
    just written is never the one pruned."""
    done = _complete(root)
    later = [p for p in done if int(p.name.removeprefix("step_")) > current]
    kept = [p for p in done if p not in later]
    stale = list(root.glob("step_*.tmp"))  # writes a crash cut short: no save is under way while one publishes
    for old in later + kept[:-keep] + stale:
        shutil.rmtree(old, ignore_errors=True)


def _complete(root: Path) -> list[Path]:
    """Checkpoint folders by step (not `.tmp` ones being written, nor `.unusable` ones set aside)."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit())


def candidates(root: Path) -> list[Path]:
    """Complete-looking checkpoints, the one `latest` names first, then newest to oldest."""
    found = _complete(root)[::-1]
    latest = root / "latest"
    if latest.exists():
        named = root / latest.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def _checked_here(fname: str, rank: int, world: int) -> bool:
    """Is this rank the one that checks the digest of tensor file `fname`? Old rank k's files on
    rank k mod world (the JSON files, small, on every rank)."""
    return not fname.startswith("rank") or int(fname[4:9]) % world == rank


def verify(path: Path, rank: int, world: int = 1) -> dict:
    """Raise CheckpointError unless every file is present at its recorded size, the (small) JSON files
    and the tensor files this rank checks match their digests. Returns meta.json."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: meta.json unreadable ({e})") from None
    for fname, info in sorted(meta["files"].items(), key=lambda kv: not kv[0].endswith(".json")):  # cheap first
        p = path / fname
        if not p.exists():
            raise CheckpointError(f"{path.name}: {fname} is missing")
        if fname.endswith(".json") and sha256(p) != info["sha256"]:
            raise CheckpointError(f"{path.name}: {fname} was changed after it was written (its sha256 differs)")
        size = p.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise CheckpointError(f"{path.name}: {fname} is {what} ({size} of {info['bytes']} bytes)")
        if not fname.endswith(".json") and _checked_here(fname, rank, world) and sha256(p) != info["sha256"]:
            raise CheckpointError(f"{path.name}: {fname} fails its sha256 digest (corrupted)")
    return meta


def find_valid(root: Path, rank: int = 0, agree: Callable[[bool], bool] = lambda ok: ok, world: int = 1,
               check: Callable[[Path, dict], None] | None = None, resuming: bool = False) -> tuple[Path, dict]:
    """The newest checkpoint that verifies on every rank (`agree` ANDs a flag over ranks), and its
    meta.json. `check(path, meta)` may refuse one more way (a CheckpointError: the reads a resume
    plans from its index); a refused checkpoint is skipped like a corrupt one. When `resuming` (the
    trainer), rank 0 renames the unusable ones newer than it to `step_X.unusable`: the run continues
    from an older step, so they belong to no future resume, and pruning must not count them (nor
    delete the good one instead). Readers (generate) change nothing."""
    tried, bad = [], []
    for path in candidates(root):
        try:
            meta, ok = verify(path, rank, world), True
            if check is not None:
                check(path, meta)
        except CheckpointError as e:
            ok, reason = False, str(e)
        if agree(ok):
            if tried and rank == 0:
                aside = ""
                if resuming:
                    for p in bad:
                        p.rename(p.with_name(p.name + ".unusable"))
                    aside = " (renamed to *.unusable)"
                print(f"teratrain: warning: skipped unusable checkpoint(s){aside}: {'; '.join(tried)}; "
                      f"{'resuming from' if resuming else 'using'} {path.name}", file=sys.stderr)
            return path, meta
        tried.append(reason if not ok else f"{path.name}: corrupt on another rank")
        bad.append(path)
    if not tried:
        fix = "train without --resume to start the run" if resuming else "train the run until it saves one"
        if resuming and (root.parent / "metrics.jsonl").is_file() and (root.parent / "metrics.jsonl").stat().st_size:
            fix = (f"it stopped before its first checkpoint: delete {root.parent} and train without --resume to "
                   "start over")
        raise CheckpointError(f"no usable checkpoint in '{root}' (it holds none); {fix}.")
    fix = (f"move or delete {root.parent} to start the run over there, or train into another --out"
           if resuming else "point --ckpt at another run or checkpoint folder")
    raise CheckpointError(f"no usable checkpoint in '{root}' ({'; '.join(tried)}); {fix}.")


def load_rank(path: Path, rank: int, prefix: str = "",
              device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of rank `rank`'s file whose keys start with `prefix` (e.g. its RNG state), and its JSON state."""
    meta = json.loads((path / f"rank{rank:05d}.json").read_text())
    meta.pop("file", None)  # the size and digest of the rank's tensor file, for meta.json only
    with safe_open(str(path / f"rank{rank:05d}.safetensors"), framework="pt", device=str(device)) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    return tensors, meta
