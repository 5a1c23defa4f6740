"""`parallel.auto = true`: the layout keys a user left unset, taken from the planner's pick for the job.

The keys: every parallel.* degree (dp, tp, pp, ep), parallel.zero, parallel.offload, train.micro_batch,
memory.recompute and the execution mode (train.compile, train.compile_mode: planner/modes.py says which
modes a config allows and when a faster one is taken, each planned with its own fastest layout);
parallel.cp and parallel.cp_form too where the pick splits sequences (the search tries cp for long ones,
search.CP_MIN_SEQ); parallel.schedule, parallel.virtual_stages and parallel.stage_layers where the pick is
a pipeline (its split is the planner's balanced one, which the executor then runs; not under
parallel.partition=profiled, which measures its own). A key given (in the TOML or with --set) is kept; the
planner searches the rest
(search.py) for the processes of the job and:
- on GPUs, takes the fastest layout whose predicted total fits the memory of the device found and whose
  pinned host memory (offload) of one node's GPUs fits the host's memory (MemTotal), exactly as
  `teratrain plan --gpus <processes> --gpu-mem <device memory> --host-mem <host memory>` would;
- on CPU, where the planner's GPU time model means nothing, follows one rule: tp = pp = ep = 1 and no
  offload (plain data parallelism over the processes), then the simplest layout whose predicted memory
  per process fits the host's memory divided by the processes on it: the lowest ZeRO stage, then no
  recomputation before selective, sqrt, full, then the largest micro-batch.
Layouts the engines refuse for this run (parallel/support.py check_supported, e.g. MoE with a pipeline) are
passed over. The choice is written into the config, so the run directory's config.toml records it and
--resume keeps it. `teratrain plan` prints the `teratrain train` command of its pick (`train_command`).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, replace

from teratrain.config_base import ConfigError
from teratrain.config_schema import Config
from teratrain.parallel.pipeline.schedules import config_name
from teratrain.parallel.support import check_supported
from teratrain.planner import modes
from teratrain.planner.hardware import GPU, GPUS, gpu_for_device, host_memory_gib
from teratrain.planner.inputs import fixed_of, shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.memory import GIB
from teratrain.planner.search import RECOMPUTE_SEARCHED, Candidate, search
from teratrain.planner.states import PlanError

# Layout field -> the config key it comes from (and goes back to)
KEYS = {"dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "ep": "parallel.ep",
        "zero": "parallel.zero", "offload": "parallel.offload", "micro_batch": "train.micro_batch",
        "recompute": "memory.recompute"}
CP_KEYS = {"cp": "parallel.cp", "cp_form": "parallel.cp_form"}  # written only where the pick has cp > 1
PP_KEYS = {"schedule": "parallel.schedule", "virtual_stages": "parallel.virtual_stages",
           "stage_layers": "parallel.stage_layers"}  # written only where the pick has pp > 1
CPU_FIXED = {"tp": 1, "pp": 1, "ep": 1, "cp": 1, "offload": "none"}


@dataclass(frozen=True)
class Target:
    """What the job runs on: a GPU (None on CPU), memory per device, the host's memory, processes per node."""

    gpu: GPU | None
    device_mem_gib: float
    host_mem_gib: float | None
    procs_per_node: int


@dataclass
class AutoChoice:
    chosen: dict[str, object]  # config key -> the value the planner chose
    kept: list[str]  # config keys the user gave
    note: str  # the start-up summary's line

    def sets(self) -> list[str]:
        """--set items that give the chosen keys."""
        return [f"{k}={_literal(v)}" for k, v in self.chosen.items()]


def layout_sets(lay: Layout, skip: tuple[str, ...] = ()) -> list[str]:
    """--set items that make a run take layout `lay` (minus the config keys in `skip`)."""
    out = [f"{key}={_literal(_value(lay, field))}" for field, key in _keys(lay).items() if key not in skip]
    if lay.recompute == "every-k" and "memory.recompute_every" not in skip:
        out.append(f"memory.recompute_every={lay.recompute_every}")
    return out


def _keys(lay: Layout, partition: str = "layers") -> dict[str, str]:
    """The layout fields a run needs set: KEYS, CP_KEYS where the layout splits sequences, PP_KEYS
    where it is a pipeline (stage_layers only where the executor would split by count, or where an end
    stage is empty, which no profiled split makes)."""
    split = lay.stage_layers and (partition == "layers" or 0 in (lay.stage_layers[0], lay.stage_layers[-1]))
    pp = {f: k for f, k in PP_KEYS.items() if f != "stage_layers" or split}
    return {**KEYS, **(CP_KEYS if lay.cp > 1 else {}), **(pp if lay.pp > 1 else {})}


def _value(lay: Layout, field: str):
    """A layout field as its config key holds it (the schedule by its config name, the split a list)."""
    v = getattr(lay, field)
    return config_name(v) if field == "schedule" else list(v) if isinstance(v, tuple) else v


def _literal(v) -> str:
    if isinstance(v, list):  # --set reads TOML: [7, 8, 8]
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)  # --set reads a bare word (none, full) as a string


def job_target(cfg: Config, procs_per_node: int) -> Target:
    """The devices of this job as the planner sees them (no CUDA context is made: only the device's
    properties are read)."""
    import torch

    host = host_memory_gib()
    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        per_proc = host / procs_per_node if host is not None else math.inf
        return Target(None, per_proc, None, procs_per_node)
    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
    gpu = gpu_for_device(props.name, props.total_memory)
    return Target(gpu, gpu.memory_gib, host, procs_per_node)


def for_job(cfg: Config, world: int, procs_per_node: int) -> AutoChoice:
    """`resolve` for the devices this process sees."""
    return resolve(cfg, world, job_target(cfg, procs_per_node))


def resolve(cfg: Config, world: int, target: Target) -> AutoChoice:
    """Choose the keys `cfg` leaves unset (module docstring), write them into `cfg`, and say why."""
    p = cfg.parallel
    if p.sync != "allreduce":
        raise ConfigError(f"parallel.auto plans all-reduce data parallelism, but parallel.sync={p.sync}; unset "
                          "parallel.sync or set parallel.auto=false and give the layout.")
    fixed = fixed_of(cfg)
    kept = [key for field, key in KEYS.items() if field in fixed]
    allowed = modes.allowed(cfg, target.gpu.name if target.gpu is not None else None)
    if len(kept) == len(KEYS) and len(allowed) == 1:
        return AutoChoice({}, kept, "auto layout: every layout key is given, nothing left to choose")
    given = set(fixed)  # the user's, not the CPU's own limits below
    if target.gpu is None:
        fixed = {**{k: v for k, v in CPU_FIXED.items() if k not in fixed}, **fixed}
    picks = {}
    for mode in allowed:
        if mode == modes.BLOCKS and modes.COMPILED in picks and not modes.blocks_may_help(picks[modes.COMPILED][2]):
            continue
        picks[mode] = _fastest(modes.with_mode(cfg, mode), world, target, fixed)
    planned = {mode: best.time.step_time_s for mode, (best, _, _) in picks.items() if best is not None}
    if not planned:  # the simplest mode's reason
        cands = picks[allowed[0]][2]
        if isinstance(cands, PlanError):
            raise ConfigError(f"parallel.auto: {cands}")
        raise ConfigError(_nothing(shape_of(cfg), world, target, kept, cands))
    mode = modes.pick(planned)
    best, fitting, _ = picks[mode]
    kept += [key for field, key in {**CP_KEYS, **PP_KEYS}.items() if field in given]
    chosen = {key: _value(best.layout, field) for field, key in _keys(best.layout, p.partition).items()
              if key not in kept}
    if len(allowed) > 1:  # a mode chosen, not one the config fixes
        chosen.update(modes.chosen_keys(cfg, mode))
    kept += [key for key in modes.KEYS if key.split(".")[1] in cfg.train.model_fields_set]
    modes.apply(cfg, chosen)
    if best.layout.recompute == "every-k" and "recompute" not in fixed:
        cfg.memory.recompute_every = best.layout.recompute_every
    return AutoChoice(chosen, kept, _note(chosen, kept, best, fitting, world, target,
                                          modes.describe(mode, planned, len(allowed))))


def _fastest(cfg: Config, world: int, target: Target, fixed: dict) -> tuple:
    """(the layout parallel.auto takes for `cfg` as it runs, or None; how many fit; every candidate, or the
    PlanError that says why this mode has none, e.g. CUDA graphs where ZeRO-3 is given)."""
    shape, train = shape_of(cfg), training_of(cfg)
    gpu = target.gpu or replace(GPUS["h100"], context_gib=0.0)  # on CPU: memory arithmetic only
    try:
        cands = search(shape, train, world, gpu, fixed, target.device_mem_gib, target.host_mem_gib,
                       "cuda" if target.gpu is not None else "cpu")
    except PlanError as e:
        return None, 0, e
    fitting = [c for c in cands if c.fits]
    if target.gpu is None:
        fitting.sort(key=_cpu_rule)
    return next((c for c in fitting if _runnable(cfg, c.layout)), None), len(fitting), cands


def _cpu_rule(c: Candidate) -> tuple:
    lay = c.layout
    rc = RECOMPUTE_SEARCHED.index(lay.recompute) if lay.recompute in RECOMPUTE_SEARCHED else len(RECOMPUTE_SEARCHED)
    return lay.zero, rc, -lay.micro_batch


def _runnable(cfg: Config, lay: Layout) -> bool:
    """Would the engines run `cfg` with layout `lay` (the config's own checks, then the engines')?"""
    trial = cfg.model_copy(deep=True)
    try:
        modes.apply(trial, {key: _value(lay, field) for field, key in _keys(lay, cfg.parallel.partition).items()})
        Config.model_validate(trial.model_dump())
        check_supported(trial)
        trial.microbatches(lay.dp)
    except (ConfigError, ValueError):
        return False
    return True


def _note(chosen: dict, kept: list[str], best: Candidate, fitting: int, world: int, target: Target, mode: str) -> str:
    picked = " ".join(f"{k.split('.')[1]}={v}" for k, v in chosen.items()  # every key is unique after its dot
                      if k not in modes.KEYS)  # the mode: its own clause
    m, t = best.memory, best.time  # its memory per process is the summary's own line (startup.py): not said twice
    if target.gpu is None:
        why = (f"the simplest of {fitting} layouts that fit {target.device_mem_gib:,.1f} GiB per process on this "
               f"CPU host (rule: plain data parallelism, lowest ZeRO stage, least recomputation, largest "
               f"micro-batch)")
    else:
        why = (f"the fastest of {fitting} layouts that fit for {world} process(es) on {target.gpu.name.upper()} "
               f"({target.device_mem_gib:,.1f} GiB); planner: {t.step_time_s:,.3f} s per step, MFU {t.mfu:.1%}")
        if m.host:
            why += f", {m.host / GIB:,.1f} GiB pinned host memory per GPU"
    given = f"; kept as given: {', '.join(kept)}" if kept else ""
    return f"auto layout: {picked or 'nothing'} chosen, {why}; {mode}{given}"


def _nothing(shape, world: int, target: Target, kept: list[str], cands: list[Candidate]) -> str:
    """One sentence: why no layout can be chosen for this job, and what to change."""
    fitting = [c for c in cands if c.fits]
    if fitting:  # they fit, but the engines refuse every one of them for this run
        return (f"parallel.auto: the {len(fitting)} layouts of {world} process(es) that fit cannot run this "
                "configuration (e.g. a mixture of experts under a pipeline); give parallel.pp or set "
                "parallel.auto=false with a layout of your own.")
    least = min(cands, key=lambda c: c.memory.total)
    if target.gpu is None:
        return (f"parallel.auto: no layout of {shape.name} fits the {target.device_mem_gib:,.1f} GiB of host memory "
                f"each of the {target.procs_per_node} process(es) on this CPU host has: the leanest needs "
                f"{least.memory.total / GIB:,.1f} GiB; use a smaller model or fewer processes per host.")
    on_gpu = [c for c in cands if c.memory.total <= target.device_mem_gib * GIB]
    unset = f", or unset {', '.join(kept)} so the planner may change them" if kept else ""
    if on_gpu:
        lean = min(on_gpu, key=lambda c: c.memory.host)
        return (f"parallel.auto: every layout of {shape.name} that fits the GPUs of this job offloads more than the "
                f"host's {target.host_mem_gib:,.0f} GiB (the leanest pins {lean.memory.host / GIB:,.1f} GiB per GPU); "
                f"launch on more GPUs{unset}.")
    return (f"parallel.auto: no layout of {shape.name} fits the {target.device_mem_gib:,.1f} GiB of each GPU on "
            f"{world} process(es): the leanest ({_words(least.layout)}) needs {least.memory.total / GIB:,.1f} GiB; "
            f"launch more processes (`teratrain plan` with this config and --gpus finds how many){unset}.")


def _words(lay: Layout) -> str:
    return " ".join(f"{field}={getattr(lay, field)}" for field in KEYS)


def train_command(config: str | None, sets: list[str], lay: Layout, gpus: int, gpus_per_node: int,
                  skip: tuple[str, ...]) -> list[str]:
    """The argv that trains with layout `lay` on `gpus` GPUs: `teratrain train --nproc N` on one node,
    torchrun on every node beyond that. `config` (a TOML file) and `sets` (--set items) describe the
    model and the run; `skip` are the config keys they already give."""
    said = {s.split("=", 1)[0] for s in sets}  # a key given once (a --set the user gave) is not said again
    layout = [s for s in layout_sets(lay, skip) if s.split("=", 1)[0] not in said]
    args = ([config] if config else []) + [a for s in sets + layout for a in ("--set", s)]
    if gpus <= gpus_per_node:
        return ["teratrain", "train", *(["--nproc", str(gpus)] if gpus > 1 else []), *args]
    nodes = -(-gpus // gpus_per_node)
    return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=HEAD_NODE:29500", "-m", "teratrain", "train", *args]


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)
