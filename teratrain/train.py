"""The training loop, and only the loop: setup lives in the modules it calls."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from teratrain import checkpoint as ckpt
from teratrain import moe_metrics
from teratrain.checkpoint.state import rng_state, set_rng_state
from teratrain.config import Config, ConfigError, to_toml, validate
from teratrain.data.loader import Batches, prepare
from teratrain.fsio import atomic_write_bytes
from teratrain.memory.precision import autocast
from teratrain.mesh import Runtime, init_runtime
from teratrain.metrics import MetricsLog, peak_flops, peak_memory_bytes, plot_loss, read_metrics
from teratrain.models.transformer import Transformer, flops_per_token
from teratrain.optim.engine import train_step
from teratrain.optim.lr import lr_at, scaled_lr
from teratrain.parallel.comm import AVG, all_reduce, any_rank_false, broadcast_object
from teratrain.parallel.parallelize import check_supported, parallelize


def run(cfg: Config, out: str | None = None, resume: bool = False) -> dict:
    """Train as configured; returns a summary. Collective: every rank of the job calls it."""
    check_supported(cfg)  # before any process group or data work, so bad input fails fast
    rt = init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    check_batch(cfg, rt.dims.dp)
    run_dir = _run_dir(out, resume, rt)
    data = prepare(cfg.data, cfg.model.vocab_size, builder=rt.local_rank == 0, wait=rt.barrier)
    seed_everything(cfg.train.seed + rt.dp_rank)  # dropout streams differ across data-parallel replicas
    with torch.device("meta"):  # materialized by parallelize(), shard by shard where sharded
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)

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
    rt.barrier()
    if rt.is_server:  # parameter-server ranks answer the workers instead of running the loop
        engine.serve(save=lambda step: _save(run_dir, step, cfg, rt, engine))
        return {"run_dir": str(run_dir), "step": None, "engine": engine}
    summary = _loop(cfg, rt, model, engine, data, run_dir, start)
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
    flops_tok = flops_per_token(m)
    log = MetricsLog(run_dir, cfg.metrics.tensorboard, append=start > 0) if rt.is_main else None
    bar = tqdm(total=tc.steps, initial=start, disable=not (rt.is_main and cfg.metrics.progress),
               desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    last = {}
    for step in range(start, tc.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, peak_lr, cfg.optim.warmup_steps, tc.steps, cfg.optim.schedule, cfg.optim.min_lr_ratio)
        model.train()
        micro = list(train_batches.micro_batches(step, rt.dp_rank, rt.dims.dp, tc.micro_batch, rt.device))
        stats, local_loss = train_step(model, engine, micro, cfg.memory.precision, lr)
        extra = dict(getattr(stats, "metrics", None) or {})  # engine-specific; a "loss" there is already averaged
        extra.update(moe_metrics.step_metrics(model, rt))  # per MoE layer (collective over dp)
        loss_val = extra.pop("loss") if "loss" in extra else _mean_over_ranks(local_loss, rt)
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        dt = time.perf_counter() - t0
        done = step + 1
        tps = tokens_per_step / dt
        last = {"step": done, "loss": loss_val, "lr": lr, "tokens_per_s": tps,
                "mfu": flops_tok * tps / (peak * rt.dims.workers) if peak else None,
                "grad_norm": stats.grad_norm if not stats.skipped else None,
                "peak_mem_bytes": peak_memory_bytes(rt.device), "skipped_steps": engine.skipped_steps,
                "loss_scale": stats.loss_scale, "tokens": done * tokens_per_step, "step_time_s": dt, **extra}
        if step == start:
            last["model_state_bytes"] = engine.last_state_bytes
        if val_batches and (done == tc.steps or (tc.eval_every and done % tc.eval_every == 0)):
            last["eval_loss"] = evaluate(model, val_batches, cfg, rt)
        if log:
            log.write(last)
        if done % tc.log_every == 0 or done == tc.steps:
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
        bar.update(1)
        if done == tc.steps or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0):
            _save(run_dir, done, cfg, rt, engine)
    bar.close()
    if log:
        log.close()
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        moe_metrics.plot_moe_load(run_dir / "metrics.jsonl", run_dir / "moe_load.png")
    summary = {"run_dir": str(run_dir), **{k: last.get(k) for k in ("step", "loss", "eval_loss", "tokens_per_s", "mfu")}}
    return {**summary, "engine": engine}  # the engine, for tests and programmatic callers


@torch.no_grad()
def evaluate(model, batches: Batches, cfg: Config, rt: Runtime) -> float:
    """Mean loss over the fixed held-out set (the same samples for every layout). Micro-batch i goes
    to rank i mod dp; every rank runs the same number of forwards (a rank past the end repeats
    micro-batch 0 and does not count it), since a ZeRO-3 forward is itself a collective."""
    model.eval()
    mb, n, dp = cfg.train.micro_batch, cfg.train.eval_batches, rt.dims.dp
    total = torch.zeros(2, device=rt.device)  # (sum of micro-batch mean losses, count)
    for i in range(rt.dp_rank, math.ceil(n / dp) * dp, dp):
        real = i < n
        x, y = batches.get(0, (i if real else 0) * mb, ((i if real else 0) + 1) * mb, rt.device)
        with autocast(cfg.memory.precision, rt.device):
            loss = model(x, y).float()
        if real:
            total += torch.stack([loss, torch.ones_like(loss)])
    all_reduce(total, rt.dp_group)
    model.train()
    return float(total[0] / total[1])


def _mean_over_ranks(x: torch.Tensor, rt: Runtime) -> float:
    x = x.clone()
    all_reduce(x, rt.dp_group, op=AVG)
    return float(x)


def check_batch(cfg: Config, dp: int) -> None:
    per_step = cfg.train.micro_batch * dp
    if cfg.train.global_batch % per_step:
        raise ConfigError(f"train.global_batch ({cfg.train.global_batch}) must be a multiple of train.micro_batch x dp "
                          f"= {cfg.train.micro_batch} x {dp} = {per_step}; change one of them.")


def check_out(out: str, resume: bool) -> Path:
    """--out must be a folder, and a fresh run must not overwrite another run's checkpoints."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; give a folder for the run.")
    if not resume and (path / "checkpoints").exists():
        raise ConfigError(f"--out {path} already holds a run; pass --resume to continue it or choose another --out.")
    return path


def _run_dir(out: str | None, resume: bool, rt: Runtime) -> Path:
    """--out if given; with --resume alone, the newest run under runs/; else runs/<timestamp>.
    Decided on rank 0 and shared, so every rank writes to the same place."""
    if out:
        path = check_out(out, resume)
    elif resume:
        runs = sorted(p.parent.parent for p in Path("runs").glob("*/checkpoints/latest"))
        if not runs:
            raise ConfigError("--resume found no run with a checkpoint under runs/; pass --out DIR of the run to resume.")
        path = runs[-1]
    else:
        path = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
        if rt.is_main:
            while path.exists():
                path = path.with_name(path.name + "_")
    return Path(broadcast_object(str(path), rt.world_group))


def _save(run_dir: Path, step: int, cfg: Config, rt: Runtime, engine) -> None:
    tensors, meta = engine.state_tensors()
    rng_t, rng_meta = rng_state()
    tensors.update(rng_t)
    meta.update(rng=rng_meta, step=step, data={"next_step": step, "samples_seen": step * cfg.train.global_batch})
    ckpt.save(run_dir / "checkpoints", step, rt.rank, rt.world, tensors, meta, cfg.checkpoint.keep,
              global_meta={"dims": vars(rt.dims), "config": cfg.model_dump()}, barrier=rt.barrier)


def _restore(run_dir: Path, cfg: Config, rt: Runtime, engine) -> int:
    """Load the newest usable checkpoint of `run_dir` into the engine and RNGs; return its step."""
    path, saved = ckpt.find_valid(run_dir / "checkpoints", rt.rank, agree=lambda ok: any_rank_false(ok, rt.world_group, rt.device))
    _check_compatible(validate(saved["config"]), cfg, run_dir)
    if saved["dims"] != vars(rt.dims):
        raise ConfigError(f"the checkpoint was written with layout {saved['dims']} but this run has {vars(rt.dims)}; "
                          "resume with the same parallel.* degrees and process count.")
    tensors, meta = ckpt.load_rank(path, rt.rank)
    engine.load_state(tensors, meta)
    set_rng_state(tensors, meta["rng"])
    step = meta["step"]
    if rt.is_main:  # drop metrics a crashed run logged after this checkpoint
        mpath = run_dir / "metrics.jsonl"
        if mpath.exists():
            kept = [r for r in read_metrics(mpath) if r["step"] <= step]
            atomic_write_bytes(mpath, "".join(json.dumps(r) + "\n" for r in kept).encode())
        atomic_write_bytes(run_dir / "config.toml", to_toml(cfg).encode())
    return step


def _check_compatible(saved: Config, cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose model shape or optimizer-state layout differs from the checkpoint's."""
    pairs = [(f"model.{k}", getattr(saved.model, k), getattr(cfg.model, k)) for k in type(cfg.model).model_fields]
    pairs += [("optim.name", saved.optim.name, cfg.optim.name),
              ("memory.precision (master weights)", saved.use_master_weights, cfg.use_master_weights)]
    # how the update state is laid out and held: replicas, shards, flat groups, servers
    pairs += [(f"parallel.{k}", getattr(saved.parallel, k), getattr(cfg.parallel, k))
              for k in ("sync", "zero", "offload", "num_servers")]
    if cfg.parallel.zero in (1, 2):  # stage 1/2 groups are buckets of bucket_mb
        pairs.append(("parallel.bucket_mb", saved.parallel.bucket_mb, cfg.parallel.bucket_mb))
    for key, old, new in pairs:
        if old != new:
            what = "model config" if key.startswith("model.") else "setting"
            raise ConfigError(f"{key} is {new!r} but the checkpoint in {run_dir} was written with {old!r}; "
                              f"resume with the same {what}.")


def seed_everything(seed: int) -> None:
    """Seed every RNG a run may draw from (torch CPU and CUDA, Python, NumPy); all are checkpointed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
