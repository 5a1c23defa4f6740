"""What a run says before its first step, and the checks made before a model is built: its model
states against this machine's free memory (`check_host_memory`), and its checkpoint against the run
directory's free disk (`check_disk`: the planner's bytes of one checkpoint, planner/disk.py, against
shutil.disk_usage; a run whose kept checkpoints will not fit gets a warning line in the summary).

The summary (rank 0, stderr) names the model (the preset, the `model.init_from` folder, or the class of
a model of the user's own) and its parameter count, the device and process count, the layout (dp, tp,
pp and its schedule, ep, zero, offload, precision, recompute, accumulation), the tokens per step, the memory
per process the planner predicts (teratrain.planner: the same arithmetic as `teratrain plan`) and a
warning when that will not fit the device, what checkpoint.resume=auto decided (continue or start the
run), and the step a resumed run continues from. The planner
only informs: if it cannot model a layout, the run goes on with a warning.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from teratrain.config_base import ConfigError
from teratrain.config_schema import Config
from teratrain.config_model import model_label

GIB = 2**30


def predict(cfg: Config, workers: int, device: torch.device | None = None, params: int | None = None):
    """The planner's MemoryBreakdown of one rank of this run (`plan_run`'s memory)."""
    return plan_run(cfg, workers, device, params).memory


def plan_run(cfg: Config, workers: int, device: torch.device | None = None, params: int | None = None):
    """The planner's Candidate (memory and time) of one rank of this run; on a GPU `device`, with the preset its
    name matches and its real memory (host bytes do not depend on the GPU; no CUDA call without one);
    on the CPU, counted as parallel.auto counts it there (no CUDA context, CPU autocast).
    `params`: a model of the user's own, known by its parameter count only (model states, no activations)."""
    from teratrain.planner.hardware import GPUS, gpu_for_device
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.layout import ModelShape
    from teratrain.planner.search import evaluate

    gpu, kind = GPUS["h100"], "cuda"
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = gpu_for_device(props.name, props.total_memory)
    elif device is not None:
        gpu, kind = replace(gpu, context_gib=0.0), "cpu"
    shape = shape_of(cfg) if params is None else ModelShape(cfg=None, bare_params=params, name="own model")
    return evaluate(shape, training_of(cfg), layout_of(cfg, workers), gpu, device=kind)


def pace_note(cfg: Config, time) -> str | None:
    """A line where the planner's TimeBreakdown `time` is host-paced (the host takes longer to issue the
    step than the GPU to run it), naming the setting that takes ops off the host; else None."""
    if not time.host_paced:
        return None
    host, gpu = time.terms["host_s"], time.terms["gpu_s"]
    fix = ("train.compile=true (fewer, fused kernels) or, better, train.compile=true "
           "train.compile_mode=reduce-overhead (CUDA graphs: one launch a graph)") if not cfg.train.compile else (
        "train.compile_mode=reduce-overhead (CUDA graphs: one launch a graph)")
    return (f"host-paced step: the host needs {host * 1e3:,.0f} ms to issue it and the GPU {gpu * 1e3:,.0f} ms to "
            f"run it (planner); set {fix}")


def host_available_bytes() -> int | None:
    """Memory this machine can still give (MemAvailable, capped by a cgroup v2 limit), or None."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and avail is not None:
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def _host_bytes(mem, device: torch.device) -> int:
    """Bytes one rank keeps in host memory: everything on a CPU run, the offloaded state on a GPU."""
    return mem.peak_allocated + mem.host if device.type == "cpu" else mem.host


def check_host_memory(cfg: Config, workers: int, local_procs: int, on_cpu: bool) -> None:
    """Refuse, before anything is allocated, a run whose model states (parameters, gradients, optimizer
    state, as the planner counts them) exceed this machine's free memory, or on a CPU its predicted peak with
    the activations: building or stepping it would end in the kernel's OOM killer, not in a sentence."""
    try:
        mem = predict(cfg, workers, torch.device("cpu") if on_cpu else None)
    except Exception:  # noqa: BLE001 - the planner informs; the summary warns that it could not
        return
    states = (mem.params + mem.grads + mem.optimizer if on_cpu else 0) + mem.host
    peak = (mem.peak_allocated if on_cpu else 0) + mem.host
    avail = host_available_bytes()
    if avail is None or peak * local_procs <= avail:
        return
    per = (lambda b: f" ({local_procs} processes x {b / GIB:,.1f} GiB)" if local_procs > 1 else "")
    if states * local_procs > avail:
        from teratrain.models.transformer import count_params

        shard = ("shard it over more GPUs with parallel.zero=3" if cfg.parallel.zero < 3 else
                 "shard it over more GPUs")
        raise ConfigError(f"this {count_params(cfg.model)['total'] / 1e9:,.2f} B-parameter model needs about "
                          f"{states * local_procs / GIB:,.1f} GiB of host memory for its parameters, gradients and "
                          f"optimizer state{per(states)}, but this machine has {avail / GIB:,.1f} GiB free; use a "
                          f"smaller model, or {shard} (`teratrain plan` finds a layout that fits).")
    raise ConfigError(f"this run's step needs about {peak * local_procs / GIB:,.1f} GiB of host memory at its peak "
                      f"(activations of train.micro_batch={cfg.train.micro_batch} x model.seq_len={cfg.model.seq_len} "
                      f"tokens included){per(peak)}, but this machine has {avail / GIB:,.1f} GiB free; lower "
                      "train.micro_batch or model.seq_len, or set memory.recompute=full.")


def checkpoint_size(cfg: Config, workers: int, own: nn.Module | None = None) -> int:
    """Bytes of one checkpoint of this run over all its ranks (planner/disk.py); `own`: a model of the
    user's own, counted from its parameters (global shapes: before parallelize)."""
    from teratrain.planner.disk import checkpoint_bytes, params_checkpoint_bytes
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    train, lay = training_of(cfg), layout_of(cfg, workers)
    if own is not None:
        params = {id(p): p for p in own.parameters()}.values()  # tied ones once
        return params_checkpoint_bytes(((tuple(p.shape), p.requires_grad) for p in params), train, lay,
                                       cfg.parallel.sync)
    return checkpoint_bytes(shape_of(cfg), train, lay, cfg.parallel.sync)


def check_disk(cfg: Config, run_dir: Path, nbytes: int, start: int = 0) -> str | None:
    """Refuse a run whose next checkpoint (`nbytes`, every rank's pieces together) does not fit the
    free space of the run directory's filesystem; return a warning line when the checkpoints it keeps
    will not: checkpoint.keep of them stay while the next is written beside them (io.py: a temporary
    folder, renamed when complete), so up to keep + 1 at once, counting those already there."""
    root = run_dir / "checkpoints"
    where = next(p for p in (root, run_dir, *run_dir.absolute().parents) if p.exists())  # a fresh run: its parent
    free = free_bytes(where)
    there = sum(1 for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()) if root.is_dir() else 0
    if nbytes > free:
        raise ConfigError(f"a checkpoint of this run needs {_size(nbytes)} (every rank's parameters and optimizer "
                          f"state, as the planner counts them) but {where} has {_size(free)} free; free disk space "
                          "there, or give --out a folder on a larger disk.")
    ck, steps = cfg.checkpoint, cfg.train.steps - start
    saves = 1 if ck.every == 0 else math.ceil(steps / ck.every) if ck.every else math.inf  # by time: unbounded
    at_once = max(1, min(saves, ck.keep + 1 - there))  # more than are there now, at the fullest moment
    if at_once * nbytes <= free:
        return None
    return (f"warning: checkpoint.keep={ck.keep} keeps {ck.keep} checkpoint(s) of {_size(nbytes)} and writes the "
            f"next beside them: up to {at_once} more on disk at once need {_size(at_once * nbytes)}, but {where} "
            f"has {_size(free)} free; the save that runs out fails (the checkpoints before it stay): lower "
            "checkpoint.keep or free disk space")


def disk_notes(cfg: Config, rt, run_dir: Path, resume: bool, own: nn.Module | None = None) -> list[str]:
    """`check_disk` on rank 0 and its verdict on every rank (collective): all refuse, or none; the
    summary's warning line, if any."""
    verdict = None
    if rt.is_main:
        try:
            start = _newest_step(run_dir) if resume else 0
            verdict = ("warn", check_disk(cfg, run_dir, checkpoint_size(cfg, rt.dims.workers, own), start))
        except ConfigError as e:
            verdict = ("refuse", str(e))
        except Exception as e:  # noqa: BLE001 - the planner informs; it never stops a run it cannot model
            verdict = ("warn", f"warning: the checkpoint size could not be predicted ({type(e).__name__}: {e})")
    kind, line = rt.broadcast(verdict)
    if kind == "refuse":
        raise ConfigError(line)
    return [line] if line else []


def _newest_step(run_dir: Path) -> int:
    """The step of the run's newest checkpoint (`latest`), 0 when it has none."""
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the filesystem of `path`."""
    return shutil.disk_usage(path).free


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def summary(cfg: Config, rt, run_dir: Path, start: int, notes: list[str] = (),
            own: nn.Module | None = None) -> str:
    """The start-up lines of a run (see the module docstring); `own`: a model of the user's own
    (`run(model_fn=...)`), described instead of `cfg.model`."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, rt.dims
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{rt.device.type}" + (f" ({torch.cuda.get_device_name(rt.device)}, {gpus} visible)"
                                   if rt.device.type == "cuda" else "")
    accum = t.global_batch // (t.micro_batch * d.dp)
    degrees = f"dp={d.dp} tp={d.tp} pp={d.pp}" + (f" ({p.schedule})" if d.pp > 1 else "") + f" ep={d.ep}"
    degrees += f" cp={d.cp} ({p.cp_form})" if d.cp > 1 else ""
    params = _param_count(own) if own is not None else None
    lines = [_model_line(cfg, own, params, run_dir), *_source_lines(m, own, run_dir),
             f"device: {where}, {rt.world} process(es)",
             f"layout: {degrees} zero={p.zero} offload={_offload(p)} sync={p.sync} precision={cfg.memory.precision} "
             f"recompute={cfg.memory.recompute}, accumulation {accum} x micro-batch {t.micro_batch}"
             + _compiled(cfg, d), *notes,
             f"batch: {t.global_batch} sequences x {m.seq_len} tokens = {t.global_batch * m.seq_len:,} tokens per "
             f"step, {t.steps} steps",
             _memory_line(cfg, rt, params),
             _resumed(cfg, run_dir, start) if start else f"run directory: {run_dir}"]
    return "\n".join(f"teratrain: {line}" for line in lines)


def _offload(p) -> str:
    """parallel.offload, with the CPU threads each rank's host optimizer step gets (memory/offload.py)."""
    if p.offload == "none":
        return "none"
    from teratrain.memory.offload import host_threads

    n = host_threads(p.offload_threads)
    return f"{p.offload} (host step on {n} CPU thread{'s' if n > 1 else ''} a rank)"


def _compiled(cfg: Config, dims) -> str:
    """`, compiled (...)` with what train.compile traces as one graph (parallelize.compile_units), or ''."""
    if not cfg.train.compile:
        return ""
    from teratrain.parallel.parallelize import compile_scope

    scope = "each block" if dims.pp > 1 or compile_scope(cfg, dims.replicas) == "block" else "the whole model"
    graphs = ", CUDA graphs" if cfg.train.cuda_graphs else ""
    return f", compiled ({scope}{graphs})"


def _model_line(cfg: Config, own: nn.Module | None, params: int | None, run_dir: Path) -> str:
    """What is trained: the user's own model by its class, a Hugging Face start by its folder and
    family (config.json's model_type), else the preset; its shape as configured, experts included."""
    from teratrain.models.transformer import count_params

    if own is not None:
        name = type(getattr(own, "hf", own)).__name__  # teratrain.CausalLM: the transformers model inside
        return f"model: {name} (your own, from model_fn), {params / 1e6:,.2f} M parameters"
    m = cfg.model
    name = model_label(m)
    family = (_source_config(m, run_dir) or {}).get("model_type", m.arch) if m.init_from else m.arch
    e = m.moe
    experts = (f", {e.num_experts} experts x top-{e.k}" + (f" in one layer of {e.every}" if e.every > 1 else "")
               + _moe_options(m) if e.enabled else "")
    n = count_params(m)["total"]
    return (f"model: {name} ({family}, {m.n_layers} layers, d_model {m.d_model}{experts}), "
            f"{n / 1e6:,.2f} M parameters" + _lora(cfg, n))


def _lora(cfg: Config, total: int) -> str:
    """`, LoRA rank 8 on wq wv: 851,968 of them trained (0.07%)`, or '' without adapters."""
    if not cfg.lora.rank:
        return ""
    from teratrain.planner.inputs import shape_of, training_of
    from teratrain.planner.states import trainable_params

    n = trainable_params(shape_of(cfg), training_of(cfg).lora)
    count = f"{n / 1e6:,.2f} M" if n >= 1e6 else f"{n:,}"
    return f", LoRA rank {cfg.lora.rank} on {' '.join(cfg.lora.targets)}: {count} of them trained ({n / total:.2%})"


def _moe_options(m) -> str:
    """The MoE options that differ from Mixtral's (which the summary leaves unsaid): expert width, first
    dense layers, shared experts, score, top-k weights, expert groups, balance, z-loss; e.g. ", width
    768, sigmoid scores, bias balance, 1 shared expert of width 1408 (gated)"."""
    e, out = m.moe, []
    if e.expert_d_ff:
        out.append(f"width {m.expert_ffn_dim}")
    if e.first_dense_layers:
        out.append(f"first {e.first_dense_layers} dense")
    if e.shared_experts:
        out.append(f"{e.shared_experts} shared expert{'s' if e.shared_experts > 1 else ''} of width "
                   f"{m.shared_ffn_dim // e.shared_experts}" + (" (gated)" if e.shared_gate else ""))
    if e.score != "softmax":
        out.append(f"{e.score} scores")
    if e.norm_topk is False:
        out.append("top-k weights not renormalized")
    if e.group_limited:
        out.append(f"experts of the best {e.groups_per_token} of {e.expert_groups} groups")
    if e.balance != "aux" or e.aux_loss_kind != "batch":
        out.append(f"{e.balance} balance" + (f" (rate {e.bias_rate:g})" if e.balance == "bias" else "")
                   + (", sequence-wise aux loss" if e.aux_loss_kind == "sequence" else ""))
    if e.z_loss_weight:
        out.append(f"z-loss {e.z_loss_weight:g}")
    return "".join(f", {o}" for o in out)


def _source_config(m, run_dir: Path) -> dict | None:
    """hf_config.source_config for the summary: None where it cannot be read (the summary only informs)."""
    from teratrain.checkpoint.hf_config import source_config

    try:
        return source_config(run_dir, m.init_from)
    except ConfigError:
        return None


def _source_lines(m, own: nn.Module | None, run_dir: Path) -> list[str]:
    """What a Mixtral start took for its aux loss (checkpoint/hf_config.py `aux_note`)."""
    if own is not None or not m.init_from or not m.moe.enabled:
        return []
    from teratrain.checkpoint.hf_config import aux_note

    hf = _source_config(m, run_dir)
    return [f"moe: {aux_note(hf, m.moe)}"] if hf else []


def _param_count(model: nn.Module) -> int:
    """Parameters of a model as built (on the meta device or a real one), tied ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _resumed(cfg: Config, run_dir: Path, start: int) -> str:
    """The step a run resumed from, and every setting that differs from that checkpoint's config."""
    from teratrain.rundir import changes

    line = f"resumed from step {start} of {run_dir}"
    try:
        saved = json.loads((run_dir / "checkpoints" / f"step_{start:08d}" / "meta.json").read_text())["config"]
    except (OSError, ValueError, KeyError):
        return line
    diff = changes(saved, cfg)
    return line + (f"; changed since then: {'; '.join(diff)}" if diff else "; settings unchanged")


def _memory_line(cfg: Config, rt, params: int | None = None) -> str:
    try:
        plan = plan_run(cfg, rt.dims.workers, rt.device, params)
    except Exception as e:  # noqa: BLE001 - never stop a run because the planner cannot model it
        return f"warning: the planner could not predict memory for this layout ({type(e).__name__}: {e})"
    mem = plan.memory
    if rt.device.type == "cuda":
        pace = pace_note(cfg, plan.time) if params is None else None
        have = torch.cuda.get_device_properties(rt.device).total_memory
        what = "memory" if params is None else "model states (activations not counted)"
        line = f"predicted {what} per GPU: {mem.total / GIB:,.2f} GiB of {have / GIB:,.1f} GiB (planner)"
        # measured: the graphed peak 1.11-1.44x the eager one at the llama-8b width, one GPU and tp=2
        # (bench/results/h200x2/2026-11-27_tensor_parallel_graphed.json)
        if cfg.train.cuda_graphs:
            line += "; eager: CUDA graphs keep pools of their own on top"
        fits = mem.total <= have
        line = line if fits else f"warning: {line}: it will not fit; run `teratrain plan` for a layout that does"
        return line + (f"\nteratrain: {pace}" if pace else "")
    need = _host_bytes(mem, rt.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = host_available_bytes()
    line = f"predicted memory per process: {need / GIB:,.2f} GiB (planner)"
    if params is not None:
        line = f"predicted model states per process: {need / GIB:,.2f} GiB (planner; activations not counted)"
    if avail is not None and need * local > avail:
        return f"warning: {line}: {local} process(es) need more than the {avail / GIB:,.1f} GiB free on this machine"
    return line


def print_summary(cfg: Config, rt, run_dir: Path, start: int, notes: list[str] = (),
                  own: nn.Module | None = None) -> None:
    if rt.is_main:
        print(summary(cfg, rt, run_dir, start, notes, own), file=sys.stderr, flush=True)
