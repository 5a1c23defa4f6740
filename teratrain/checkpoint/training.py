"""Saving a training run's state as logical tensors, and resuming it at any layout.

Save (collective): every rank lists the pieces it holds (`engine.holdings()`), the ranks agree which
of them are copies of one another (replicas, tied copies), and the first holder of each writes it.
Restore (collective): the newest checkpoint that verifies is planned on every rank (each slot of the
new layout against the stored pieces: exact coverage or a CheckpointError, so a wrong index falls
back to the previous checkpoint as corruption does), then each rank reads just its slices.

What carries over to another layout (parallel.dp, zero, offload, tp, master weights; pp and ep by
the same placements):
- parameters and elementwise optimizer state (Adam moments, momentum): resharded exactly;
- per-tensor state (Adam's step count): one value per parameter, given to every new piece;
- factored state (Adafactor, SM3 on matrices): per local piece, which those optimizers keep whole
  under any dp and ZeRO stage; a change of tp (pp, ep) cuts the pieces differently and is refused;
- loss scale, data position, schedule: global, carried over;
- per-rank RNG streams: restored only at the same degrees (dp, tp, pp, ep, servers); otherwise every
  rank reseeds from (train.seed, its dp rank, the step): dropout masks then differ from the
  unchanged run's (with dropout off nothing draws from them).
Local SGD (replicas differ between syncs) and the parameter server (per-worker clocks) resume only at
the degrees they were saved with.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import torch

from teratrain.checkpoint import io
from teratrain.checkpoint.holdings import (OPTIM, PARAM, Entry, Holdings, is_factored, ordered_params, save_entries,
                                           slot_index)
from teratrain.checkpoint.index import Index, Reader
from teratrain.checkpoint.format import DTYPE_NAMES, CheckpointError
from teratrain.checkpoint.pieces import Piece
from teratrain.checkpoint.state import rng_state, seed_everything, set_rng_state
from teratrain.config import Config, ConfigError, validate
from teratrain.config_toml import toml_value
from teratrain.models.moe import expert_biases, load_expert_biases
from teratrain.parallel.comm import all_gather_objects, any_rank_false


def save_training(root: Path, step: int, cfg: Config, rt, engine, stopped_by: int = 0) -> Path:
    """Write checkpoint `step` of the run (collective over every rank of the job); `stopped_by`: the
    signal the job saves for before it exits (recorded for the message that names this checkpoint)."""
    tensors, meta, global_meta = stage_training(step, cfg, rt, engine, stopped_by)
    return io.save(root, step, rt.rank, rt.world, tensors, meta, cfg.checkpoint.keep, global_meta=global_meta,
                   barrier=rt.barrier)


def stage_training(step: int, cfg: Config, rt, engine, stopped_by: int = 0) -> tuple[dict, dict, dict]:
    """What this rank writes for checkpoint `step` (collective: ranks agree which copies each writes):
    its tensors by key (views of the live state), its JSON state, and the checkpoint's meta."""
    meta = engine.state_meta()  # first: the parameter-server worker's SAVE makes its servers join
    entries, scalars = save_entries(engine.holdings())
    tensors, pieces = encode(first_copies(entries, rt))
    rng_t, rng_meta = rng_state()
    tensors.update(rng_t)
    meta.update(pieces=pieces, scalars=scalars, rng=rng_meta, step=step,
                data={"next_step": step, "samples_seen": step * cfg.train.global_batch},
                **_expert_biases(cfg, rt, engine))
    global_meta = {"dims": vars(rt.dims), "config": cfg.model_dump(),
                   **({"stopped_by": signal.Signals(stopped_by).name} if stopped_by else {})}
    return tensors, meta, global_meta


def _expert_biases(cfg: Config, rt, engine) -> dict:
    """{"moe_bias": {layer: bias}} of every balance=bias MoE layer of the model, on every rank: the
    bias is the same on all ranks (moe_metrics moves it by globally summed loads), so any rank's JSON
    restores any layout; pipeline stages pool theirs (collective over pp). {} without such a router."""
    if not (cfg.model.moe.enabled and cfg.model.moe.balance == "bias"):
        return {}
    model = getattr(engine, "model", None)  # a parameter server's engine holds no model
    mine = expert_biases(model) if model is not None else {}
    if rt.dims.pp > 1:
        mine = {key: bias for part in all_gather_objects(mine, rt.group("pp")) for key, bias in part.items()}
    return {"moe_bias": mine}


def encode(entries: list[Entry]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The tensors of a rank file (by key) and their pieces as the rank's JSON lists them."""
    tensors, pieces = {}, []
    for e in entries:
        data, piece = stored_form(e)
        if piece.numel == 0:  # all padding
            continue
        key = e.logical + (f"#{e.replica}" if e.replica is not None else "")
        if key in tensors:  # a second piece of one tensor in this file (not made by today's engines)
            key += f"#{piece.key()}"
        tensors[key] = data
        pieces.append({"kind": e.kind, "name": piece.name, "shape": list(piece.shape), "key": key,
                       "dtype": DTYPE_NAMES[data.dtype], "replica": e.replica, **piece.to_json()})
    return tensors, pieces


def first_copies(entries: list[Entry], rt) -> list[Entry]:
    """Drop the pieces a lower rank also holds (identical copies: data-parallel replicas, tensors
    tied across tp ranks, replicated key/value heads), so each element is written once."""
    ids = [_identity(e) for e in entries]
    everyone = all_gather_objects(ids, rt.world_group)
    lower = set().union(*everyone[:rt.rank])
    return [e for e, i in zip(entries, ids) if i not in lower]


def _identity(e: Entry) -> int:
    text = f"{e.kind}|{e.piece.name}|{e.replica}|{e.piece.key()}|{e.tensor.dtype}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def stored_form(e: Entry) -> tuple[torch.Tensor, Piece]:
    """What goes in the file: a whole box shaped like the box, its padding cut off; a flat range as is."""
    if not e.piece.is_box():
        return e.tensor.reshape(-1), e.piece
    piece = e.piece.clipped()
    data = e.tensor.reshape(e.piece.box)[tuple(slice(0, n) for n in piece.box)]
    return data, piece


# ------------------------------------------------------------------ restore

def without_init_from(cfg: Config) -> Config:
    """`cfg` initializing by seed instead of from model.init_from (a resume overwrites every weight)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": None})})


def restore_training(root: Path, cfg: Config, rt, engine, run_dir: Path) -> int:
    """Load the newest usable checkpoint under `root` into the engine and RNGs; return its step."""
    plan: dict = {}

    def check(path: Path, meta: dict) -> None:
        index = Index(path)  # a CheckpointError here (no or bad index) falls back like corruption
        check_resume(validate(meta["config"]), meta["dims"], cfg, vars(rt.dims), run_dir, index)
        reader = Reader(index)
        plan.update(reader=reader, jobs=plan_restore(reader, engine.holdings()))

    path, saved = io.find_valid(root, rt.rank, lambda ok: any_rank_false(ok, rt.world_group, rt.device),
                                rt.world, check, resuming=True)
    with plan["reader"] as reader:
        run_restore(reader, plan["jobs"])
    same = saved["dims"] == vars(rt.dims)
    rng_t, meta = io.load_rank(path, rt.rank if same else 0, prefix="rng.")
    engine.loaded(meta)
    if getattr(engine, "model", None) is not None:
        load_expert_biases(engine.model, meta.get("moe_bias", {}))
    if same:  # the same ranks: each continues its own streams
        set_rng_state(rng_t, meta["rng"])
    else:
        seed_everything(cfg.train.seed + rt.dp_rank + 1_000_003 * meta["step"])
    return meta["step"]


def plan_restore(reader: Reader, h: Holdings) -> dict:
    """Every read this rank will make, planned (and coverage-checked) before any is made."""
    values = [(e, reader.plan(e)) for e in (Entry(PARAM, s.piece(), s.tensor, h.replica) for s in h.values)]
    optimizers = []
    for opt, slots in h.optimizers:
        by_id, states = slot_index(slots), []
        for pid, p in enumerate(ordered_params(opt)):
            for key, e, like in _state_entries(reader.index, by_id[id(p)], h.replica):
                states.append((pid, p, key, e, like, reader.plan(e)))
        optimizers.append((opt, states, [by_id[id(p)].pl.name for p in ordered_params(opt)]))
    return {"values": values, "optimizers": optimizers}


def _state_entries(index: Index, slot, replica):
    """(state key, entry to fill, (shape, dtype, device) of its tensor) for each optimizer state
    tensor saved for `slot`'s parameter; the tensor itself is made when it is read."""
    piece = slot.piece()
    for kind in index.kinds_of(piece.name, OPTIM):
        key = kind[len(OPTIM):]
        shape, dtype = tuple(index.info(kind, piece.name)["shape"]), index.dtype(kind, piece.name)
        if is_factored(kind):
            key, _, owner = key.partition("@")
            if owner == piece.key():
                yield key, Entry(kind, Piece.whole_of(piece.name, shape), None, replica), (shape, dtype, "cpu")
        elif shape == piece.shape:  # elementwise: this slot's piece of it, shaped like the slot's tensor
            t = slot.tensor
            yield key, Entry(kind, piece, None, replica), (tuple(t.shape), t.dtype, t.device)
        elif not shape:  # per tensor
            yield key, Entry(kind, Piece.whole_of(piece.name, ()), None, replica), ((), dtype, "cpu")
        else:
            raise CheckpointError(f"{index.dir.name}: {kind}/{piece.name} has shape {list(shape)}, neither the "
                                  f"parameter's {list(piece.shape)} nor a scalar.")


def run_restore(reader: Reader, jobs: dict) -> None:
    with torch.no_grad():
        for e, copies in jobs["values"]:
            reader.run(copies, e.tensor)
        for opt, states, names in jobs["optimizers"]:
            state: dict[int, dict] = {}
            for pid, p, key, e, (shape, dtype, device), copies in states:
                # into the optimizer's own state tensor where it has one (AdamW, SGD: made at build), so
                # no second copy of the optimizer state is ever allocated
                target = opt.state.get(p, {}).get(key)
                if target is None or tuple(target.shape) != shape:
                    target = torch.zeros(shape, dtype=dtype, device=device)
                reader.run(copies, target)
                state.setdefault(pid, {})[key] = target
            for pid, name in enumerate(names):  # state that is no tensor (rare): JSON in the index
                for k, v in reader.index.scalars.items():
                    kind, _, owner = k.partition("/")
                    if owner == name:
                        state.setdefault(pid, {})[kind[len(OPTIM):]] = v
            # hyperparameters as configured now (a resumed run may change weight decay or betas)
            opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


# model keys a resume may change: none of them shapes or names a parameter (the context length, dropout, RoPE's
# base and scaling, the MoE losses' weights, capacity, noise and router precision, the balance's step)
RESUME_MAY_CHANGE = frozenset({"preset", "init_from", "seq_len", "dropout", "rope_theta", "rope_scaling", "init_std",
                               "moe.aux_loss_weight", "moe.aux_loss_convention", "moe.capacity_factor",
                               "moe.expert_dropout", "moe.router_dtype", "moe.noise", "moe.z_loss_weight",
                               "moe.bias_rate", "moe.aux_loss_kind"})


def check_resume(saved: Config, saved_dims: dict, cfg: Config, dims: dict, run_dir: Path, index: Index) -> None:
    """Refuse, in one sentence, a resume whose state cannot carry over: another model shape, optimizer
    or sync mode; a layout change where the state is per rank or per local piece."""
    pairs = [(f"model.{k}", getattr(saved.model, k), getattr(cfg.model, k)) for k in type(cfg.model).model_fields
             if k not in RESUME_MAY_CHANGE and k != "moe"]
    pairs += [(f"model.moe.{k}", getattr(saved.model.moe, k), getattr(cfg.model.moe, k))
              for k in type(cfg.model.moe).model_fields if f"moe.{k}" not in RESUME_MAY_CHANGE]
    pairs += [(f"{section}.{k}", getattr(getattr(saved, section), k), getattr(getattr(cfg, section), k))
              for section, k in (("optim", "name"), ("parallel", "sync"), ("lora", "rank"), ("lora", "targets"))]
    for key, old, new in pairs:
        if old != new:
            what = "model shape" if key.startswith("model.") else "setting"
            raise ConfigError(f"{key} is {toml_value(new)} but the checkpoint in {run_dir} was written with "
                              f"{toml_value(old)}; resume with the same {what}.")
    degrees = {k: v for k, v in saved_dims.items() if v != dims.get(k)}
    if degrees and cfg.parallel.sync != "allreduce":
        raise ConfigError(f"parallel.sync={cfg.parallel.sync} keeps state per rank (replicas or clocks), so it resumes "
                          f"only at the degrees it was saved with; resume with {_degrees(degrees)}.")
    moved = {k: v for k, v in saved_dims.items() if k in ("tp", "pp", "ep") and v != dims.get(k)}
    if moved and any(is_factored(t["kind"]) for t in index.tensors.values()):
        raise ConfigError(f"optim.name={cfg.optim.name} keeps factored state per local piece of each matrix, which "
                          f"another tensor split cannot use; resume with {_degrees(moved)}.")


def _degrees(saved: dict) -> str:
    return ", ".join(f"parallel.{k}={v}" for k, v in saved.items())
