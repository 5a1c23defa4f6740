"""The training loop, and only the loop: setup lives in the modules it calls."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from teratrain import moe_metrics, wandb_sink
from teratrain.checkpoint.hf_config import SOURCE_CONFIG
from teratrain.checkpoint.state import deterministic_algorithms, seed_everything
from teratrain.checkpoint.background import NUM_FLAGS, Saver
from teratrain.checkpoint.training import restore_training, save_training, stage_training, without_init_from
from teratrain.collector import Collector
from teratrain.compat import release_compiled
from teratrain.config import Config, ConfigError, load_config
from teratrain.config_toml import to_toml
from teratrain.data.loader import Batches, prepare
from teratrain.fsio import atomic_write_bytes
from teratrain.launch import Stopped, stop_after_step
from teratrain.memory.precision import autocast
from teratrain.mesh import Runtime, init_runtime
from teratrain.metrics import MetricsLog, check_sinks, peak_flops, peak_memory_bytes, plot_loss, read_metrics
from teratrain.models.protocol import model_flops_per_token
from teratrain.models.transformer import Transformer
from teratrain.optim.lr import lr_at, scaled_lr
from teratrain.parallel.comm import AVG, MAX, all_reduce
from teratrain.parallel.parallelize import parallelize
from teratrain.parallel.pipeline.runtime import step_runner
from teratrain.parallel.support import check_supported
from teratrain.progress import Progress
from teratrain.rundir import agree_run_dir, remove_if_unused
from teratrain.startup import disk_notes, print_summary


def run(cfg: Config, out: str | None = None, resume: bool = False,
        model_fn: Callable[[Config], nn.Module] | None = None, notes: list[str] | None = None) -> dict:
    """Train as configured; returns a summary (with this process's `rank`, the `engine` and `model`).
    Collective: every rank of the job calls it, and each gets the same losses. `model_fn(cfg)` builds
    a model of your own (models/protocol.py) instead of teratrain's decoder of `cfg.model`. `notes` are
    start-up lines (the CLI's parallel.auto choice); without them, parallel.auto is resolved here."""
    if cfg.parallel.auto and notes is None:
        from teratrain.planner.auto import for_job

        world = int(os.environ.get("WORLD_SIZE", "1"))
        notes = [for_job(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))).note]
    check_supported(cfg)  # before any process group or data work, so bad input fails fast
    check_sinks(cfg)
    rt = init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    check_batch(cfg, rt.dims.dp)
    existed = out is not None and Path(out).exists()
    run_dir = agree_run_dir(out, resume, rt)
    try:
        return _run(cfg, rt, run_dir, resume, model_fn, notes or [])
    except BaseException:
        if rt.is_main and not existed:  # a run that fails before its first step leaves no folder behind
            remove_if_unused(run_dir)
        raise


def _run(cfg: Config, rt: Runtime, run_dir: Path, resume: bool, model_fn, notes: list[str]) -> dict:
    """run() once the run directory is agreed: data, model, restore, summary, then the loop (or serve)."""
    if resume and (run_dir / "config.toml").exists() and cfg.parallel.stage_layers is None:
        saved = load_config(run_dir / "config.toml").parallel  # a profiled split, kept for the same stages
        if (saved.pp, saved.virtual_stages) == (cfg.parallel.pp, cfg.parallel.virtual_stages):
            cfg.parallel.stage_layers = saved.stage_layers
    data_cfg, own = cfg.data, run_dir / "tokenizer.json"
    if resume and own.is_file() and not (cfg.data.tokenizer and Path(cfg.data.tokenizer).expanduser().is_file()):
        data_cfg = cfg.data.model_copy(update={"tokenizer": str(own)})  # a resumed run's own token ids
    data = prepare(data_cfg, cfg.model.vocab_size, builder=rt.local_rank == 0, wait=rt.barrier)
    if cfg.data.document_mask and cfg.data.eot_id is None:
        cfg.data.eot_id = _eot_id(data.tokenizer_path)
    seed_everything(cfg.train.seed + rt.dp_rank)  # dropout streams differ across data-parallel replicas
    deterministic_algorithms(cfg.train.deterministic)
    if model_fn is not None:  # on the meta device or a real one: parallelize() keeps its values
        model = model_fn(cfg)
    else:
        with torch.device("meta"):  # materialized by parallelize(), shard by shard where sharded
            model = Transformer(cfg.model)
    notes = [*notes, *disk_notes(cfg, rt, run_dir, resume, model if model_fn is not None else None)]
    # a resumed run's weights come from its checkpoint: skip reading model.init_from's (maybe moved) files
    engine = parallelize(model, rt, without_init_from(cfg) if resume else cfg)

    start = 0
    if resume:
        start = _restore(run_dir, cfg, rt, engine)
        if start >= cfg.train.steps:
            raise ConfigError(f"the run in {run_dir} already reached step {start} (train.steps={cfg.train.steps}); "
                              "pass a larger --steps to continue it.")
    elif rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / "config.toml", to_toml(cfg).encode())
        if data.tokenizer_path:
            shutil.copy(data.tokenizer_path, run_dir / "tokenizer.json")
        source = Path(cfg.model.init_from).expanduser() / "config.json" if cfg.model.init_from else None
        if source is not None and model_fn is None and source.is_file():  # what `teratrain export` writes back
            shutil.copy(source, run_dir / SOURCE_CONFIG)
    if cfg.memory.fp8 != "none":
        from teratrain.memory import fp8

        notes = [*notes, fp8.note(model, cfg.memory.fp8, cfg.train.compile)]
    print_summary(cfg, rt, run_dir, start, notes, own=model if model_fn is not None else None)
    rt.barrier()
    if rt.is_server:  # parameter-server ranks answer the workers instead of running the loop
        with _stop_after_step(cfg) as stop, Collector():  # a stop: serve until the workers saved
            engine.serve(save=lambda step: _save(run_dir, step, cfg, rt, engine))
        if stop["signum"]:
            raise Stopped(stop["signum"])
        return {"run_dir": str(run_dir), "step": None, "rank": rt.rank, "engine": engine}
    try:
        summary = _loop(cfg, rt, model, engine, data, run_dir, start)
    finally:  # stopped or failed too: CUDA graphs holding NCCL work would hang the exit
        if cfg.train.cuda_graphs:
            release_compiled()
    if hasattr(engine, "close"):  # e.g. a parameter-server worker signs off
        engine.close()
    return summary


def _loop(cfg: Config, rt: Runtime, model, engine, data, run_dir: Path, start: int) -> dict:
    tc, m = cfg.train, cfg.model
    train_batches = Batches(data.train, m.seq_len, tc.seed, tc.global_batch, "train")
    val_batches = Batches(data.val, m.seq_len, tc.seed + 1, tc.eval_batches * tc.micro_batch, "val") if tc.eval_batches else None
    peak_lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_scaling, cfg.optim.base_batch, tc.global_batch)
    tokens_per_step = tc.global_batch * m.seq_len
    peak = peak_flops(rt.device, cfg.memory.precision, cfg.metrics.peak_tflops)
    flops_tok = model_flops_per_token(model, m)
    sinks = [wandb_sink.WandbSink(run_dir, cfg, resume=start > 0)] if cfg.metrics.wandb else []
    log = MetricsLog(run_dir, cfg.metrics.tensorboard, append=start > 0, sinks=sinks) if rt.is_main else None
    run_step = step_runner(model, engine, rt, cfg, run_dir)  # train_step, or the pipeline executor
    progress = Progress(tc.steps, start, rt.is_main and cfg.metrics.progress, tc.log_every)
    saver = Saver(run_dir / "checkpoints", rt, cfg.checkpoint.keep, cfg.checkpoint.async_,
                  lambda step, signum: stage_training(step, cfg, rt, engine, signum))
    last, saved_at = {}, time.monotonic()
    with _stop_after_step(cfg) as stop, Collector(tc.gc_every) as collector:
        for step in range(start, tc.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, peak_lr, cfg.optim.warmup_steps, cfg.schedule_steps, cfg.optim.schedule,
                       cfg.optim.min_lr_ratio)
            model.train()
            micro = list(train_batches.micro_batches(step, rt.dp_rank, rt.dims.dp, tc.micro_batch, rt.device))
            stats, local_loss = run_step(micro, cfg.memory.precision, lr)
            last = _record(step, stats, local_loss, lr, model, engine, rt, t0, tokens_per_step,
                           flops_tok * tokens_per_step / (peak * rt.dims.workers) if peak else None)
            done = step + 1
            collector.step(done)  # every rank at the same step, before the stop/save agreement below
            if step == start:
                last["model_state_bytes"] = engine.last_state_bytes
            if val_batches and (done == tc.steps or (tc.eval_every and done % tc.eval_every == 0)):
                last["eval_loss"] = evaluate(model, val_batches, cfg, rt, run_step.forward_loss)
            progress.step(done, last["loss"], last["tokens_per_s"], lr, last.get("eval_loss"))
            # a non-finite loss from a step that was not skipped (fp16's loss scale skips its overflows): diverged
            stop["diverged"] = not math.isfinite(last["loss"]) and last["grad_norm"] is not None
            signum, due = _stop_or_save(stop, saved_at, cfg, rt, done, saver)
            if stop["diverged"]:  # every rank agreed (_stop_or_save): end without saving these weights
                if log:
                    log.write(last)
                progress.close()
                raise ConfigError(f"the loss became {last['loss']} at step {done} (optim.lr {lr:g}): training "
                                  "diverged; start again, or resume from a checkpoint written before it, with a "
                                  "lower optim.lr.")
            if done == tc.steps or due or signum:  # the last save of a job is complete before it ends
                saver.save(done, stopped_by=signum, wait=done == tc.steps or bool(signum))
                saved_at = time.monotonic()
            if saves := saver.take():  # each save once complete: blocked and write seconds
                last["checkpoints"] = saves
            if log:
                log.write(last)
            if signum and done < tc.steps:  # every rank saved this step's checkpoint: now exit
                progress.close()
                if hasattr(engine, "close"):  # a parameter-server worker signs off, so its servers exit too
                    engine.close()
                raise Stopped(signum)
    progress.close()
    if log:
        log.close()
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        moe_metrics.plot_moe_load(run_dir / "metrics.jsonl", run_dir / "moe_load.png")
    summary = {"run_dir": str(run_dir), "rank": rt.rank,
               **{k: last.get(k) for k in ("step", "loss", "eval_loss", "tokens_per_s", "mfu")}}
    return {**summary, "engine": engine, "model": model}  # for tests and programmatic callers


@torch.no_grad()
def evaluate(model, batches: Batches, cfg: Config, rt: Runtime, forward_loss=None) -> float:
    """Mean loss over the fixed held-out set (the same samples for every layout). Micro-batch i goes
    to rank i mod dp; every rank runs the same number of forwards (a rank past the end repeats
    micro-batch 0 and does not count it), since a ZeRO-3 forward is itself a collective (and so is a
    pipeline's: `forward_loss` runs it through every stage)."""
    model.eval()
    mb, n, dp = cfg.train.micro_batch, cfg.train.eval_batches, rt.dims.dp
    total = torch.zeros(2, device=rt.device)  # (sum of micro-batch mean losses, count)
    for i in range(rt.dp_rank, math.ceil(n / dp) * dp, dp):
        real = i < n
        x, y = batches.get(0, (i if real else 0) * mb, ((i if real else 0) + 1) * mb, rt.device)
        with autocast(cfg.memory.precision, rt.device):
            loss = (forward_loss or model)(x, y).float()
        if real:
            total += torch.stack([loss, torch.ones_like(loss)])
    all_reduce(total, rt.dp_group)
    model.train()
    return float(total[0] / total[1])


def _record(step: int, stats, local_loss, lr: float, model, engine, rt: Runtime, t0: float, tokens_per_step: int,
            mfu_seconds: float | None) -> dict:
    """The metrics.jsonl record of the step begun at `t0` (a collective: losses and MoE statistics are
    averaged); `mfu_seconds`: the step time at which MFU would be 1."""
    extra = _slowest(dict(stats.metrics), rt)  # engine-specific (optim/engine.py StepStats)
    extra.update(moe_metrics.step_metrics(model, rt))  # per MoE layer (collective over dp)
    loss_val = extra.pop("loss") if "loss" in extra else _mean_over_ranks(local_loss, rt)
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    dt = time.perf_counter() - t0
    done = step + 1
    return {"step": done, "loss": loss_val, "lr": lr, "tokens_per_s": tokens_per_step / dt,
            "mfu": mfu_seconds / dt if mfu_seconds is not None else None,
            "grad_norm": stats.grad_norm if not stats.skipped else None,
            "peak_mem_bytes": peak_memory_bytes(rt.device), "skipped_steps": engine.skipped_steps,
            "loss_scale": stats.loss_scale, "tokens": done * tokens_per_step, "step_time_s": dt, **extra}


def _lockstep(cfg: Config) -> bool:
    """Whether the workers may agree at every step: not those of an asynchronous parameter server
    (parallel.staleness unset or > 0), which run steps apart by design."""
    return cfg.parallel.sync != "param-server" or cfg.parallel.staleness == 0


def _stop_after_step(cfg: Config):
    """Stop signals wait for the end of the step where the workers can agree on it; elsewhere they
    stop the process at once (the last checkpoint stays intact)."""
    return stop_after_step(cfg.checkpoint.stop_timeout_s) if _lockstep(cfg) else nullcontext({"signum": None})


def _stop_or_save(stop: dict, saved_at: float, cfg: Config, rt: Runtime, done: int,
                  saver: Saver | None = None) -> tuple[int, bool]:
    """(the signal that stopped any rank, else 0; whether a checkpoint is due at step `done`), the same
    on every worker, and stop["diverged"] made true on every worker where any saw a loss that is not finite:
    one all-reduce of a few numbers per step, since a signal reaches ranks at different
    times (or only some of them) and their clocks disagree on when checkpoint.every_minutes is up; the
    same all-reduce tells whether every rank finished writing a background save (which then completes).
    An asynchronous parameter server's workers agree on nothing between checkpoints: steps only."""
    ck = cfg.checkpoint
    by_steps = bool(ck.every and done % ck.every == 0)
    if not _lockstep(cfg):
        stop["diverged"] = False  # a worker that ended alone would leave its servers waiting: it goes on
        return 0, by_steps
    by_time = ck.every is None and time.monotonic() - saved_at >= 60 * ck.every_minutes
    writes = saver.flags() if saver else [0] * NUM_FLAGS
    flags = torch.tensor([stop["signum"] or 0, int(by_time), int(stop.get("diverged", False)), *writes],
                         dtype=torch.int64, device=rt.device)
    all_reduce(flags, rt.group("world"), op=MAX)
    stop["diverged"] = bool(flags[2])  # any rank's loss not finite: every rank ends at this step
    if saver:
        saver.agree(flags[3:].tolist())
    return int(flags[0]), bool(flags[1]) or by_steps


def _slowest(metrics: dict, rt: Runtime) -> dict:
    """`metrics` with its times (keys ending "_ms", which every rank reports) the slowest rank's: the
    rank that sets the step's pace (a collective over all ranks when there are any)."""
    keys = sorted(k for k in metrics if k.endswith("_ms"))
    if keys and rt.world > 1:
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=rt.device)
        all_reduce(t, rt.group("world"), op=MAX)
        metrics.update(zip(keys, (round(v, 3) for v in t.tolist())))
    return metrics


def _mean_over_ranks(x: torch.Tensor, rt: Runtime) -> float:
    x = x.clone()
    all_reduce(x, rt.dp_group, op=AVG)
    return float(x)


def _eot_id(tokenizer_path: Path | None) -> int:
    """The tokenizer's end-of-text id, which cuts documents under data.document_mask."""
    from tokenizers import Tokenizer

    from teratrain.data.tokenizer import EOT

    eot = Tokenizer.from_file(str(tokenizer_path)).token_to_id(EOT) if tokenizer_path else None
    if eot is None:
        raise ConfigError(f"data.document_mask cuts documents at {EOT} and this run's tokenizer has no such token; "
                          "set data.eot_id to the id that ends each document.")
    return eot


def check_batch(cfg: Config, dp: int) -> None:
    """The global batch splits into whole micro-batches per data-parallel rank, and their number
    suits the pipeline schedule (Config.microbatches says which key to change)."""
    cfg.microbatches(dp)


def _save(run_dir: Path, step: int, cfg: Config, rt: Runtime, engine, stopped_by: int = 0) -> None:
    save_training(run_dir / "checkpoints", step, cfg, rt, engine, stopped_by)


def _restore(run_dir: Path, cfg: Config, rt: Runtime, engine) -> int:
    """Load the newest usable checkpoint of `run_dir` (any layout) into the engine and RNGs; return its step."""
    step = restore_training(run_dir / "checkpoints", cfg, rt, engine, run_dir)
    if rt.is_main:  # drop metrics a crashed run logged after this checkpoint
        mpath = run_dir / "metrics.jsonl"
        if mpath.exists():
            kept = [r for r in read_metrics(mpath) if r["step"] <= step]
            atomic_write_bytes(mpath, "".join(json.dumps(r) + "\n" for r in kept).encode())
        atomic_write_bytes(run_dir / "config.toml", to_toml(cfg).encode())
    return step
