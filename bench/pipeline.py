"""Pipeline schedules on every GPU of one host (pp = GPU count, dp = tp = 1), in one torchrun job.

    python bench/pipeline.py                      # launches itself on every GPU (needs >= 2)
    torchrun --nproc-per-node=N bench/pipeline.py # the same, launched by hand (any pp = N)
    python bench/pipeline.py --smoke              # 2 CPU processes over gloo, tiny shapes: checks the script
    python bench/pipeline.py --parity             # + NCCL parity of 1F1B, interleaved 1F1B, ZB-H1 vs 1 GPU
    python bench/pipeline.py --parity-only        # only that (each part fits a 10-minute job)

For GPipe, 1F1B, interleaved 1F1B (v=2) and ZB-H1, and m in {4, 8, 16} micro-batches per step:
- tokens/s: the median wall time of `--steps` whole steps (the engine's update included) after
  `--warmup` steps, untimed inside (no event or barrier in the step);
- measured bubble: from one more step timed per action (CUDA events on the compute stream, ranks
  aligned by a barrier), the idle share of pp x (first start .. last end);
- simulated bubble: the simulator run on the same schedule with that step's per-stage median action
  times (parallel/pipeline/timing.py), so the two differ by what the simulator leaves out
  (communication, launch gaps); `bubble_ratio` = measured / simulated.
Then our interleaved 1F1B against `torch.distributed.pipelining.ScheduleInterleaved1F1B` on the same
stages (the same chunk modules, split and optimizer step): `interleaved_vs_torch` = our tokens/s over
torch's at each m (target >= 1.0).
With --parity the launcher first trains, through `teratrain train`, 1F1B, interleaved 1F1B and ZB-H1
at pp = GPU count against one GPU on the same global batch: llama-1b's width with 8 layers, bf16,
20 steps; every step's loss within 2e-2 relative (bf16 keeps 8 mantissa bits, and the two runs
accumulate in another order; the gloo tests show fp32 pipelining is bitwise).
Model: a Llama of llama-1b's width (d 2048, 32 heads, 8 KV heads, d_ff 8192, 32k vocab) with 10
layers per GPU, seq 2048, micro-batch 2, bf16 autocast over fp32 weights, no recomputation: GPipe at
m=16 holds 16 micro-batches of activations, which the planner puts at 111 GiB of an H200's 140
(`teratrain plan --model llama-1b --gpus 2 --gpu h200 --set model.n_layers=20 --set parallel.pp=2
--set parallel.schedule=gpipe --set train.micro_batch=2 --set train.global_batch=32 ...`). NVLink
multicast stays off.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MICROBATCHES = [4, 8, 16]
SMOKE_MICROBATCHES = [4, 8]  # --smoke: the script's paths, in less time


def model_sets(pp: int, smoke: bool) -> list[str]:
    if smoke:
        return ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=512",
                "train.micro_batch=2", "memory.precision=fp32", "train.device=cpu"]
    return ["model.preset=llama-1b", "model.vocab_size=32000", f"model.n_layers={10 * pp}", "model.seq_len=2048",
            "train.micro_batch=2", "memory.precision=bf16"]


_RUNTIME = []  # one runtime (and its process groups) for every model this job builds


def build(sets: list[str]):
    from teratrain.config import load_config
    from teratrain.mesh import init_runtime
    from teratrain.models.transformer import Transformer
    from teratrain.parallel.parallelize import parallelize

    cfg = load_config(None, sets + ["train.eval_batches=0", "metrics.progress=false", "optim.warmup_steps=0"])
    if not _RUNTIME:
        _RUNTIME.append(init_runtime(cfg))
    rt = _RUNTIME[0]
    cfg.parallel.dp = rt.dims.dp
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return cfg, rt, model, parallelize(model, rt, cfg)


def batches(cfg, m: int, device):
    g = torch.Generator().manual_seed(0)
    rows = m * cfg.train.micro_batch
    t = torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.seq_len + 1), generator=g).to(device)
    return t[:, :-1], t[:, 1:]


def wall(step, steps: int, device) -> float:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours(base: list[str], schedule: str, m: int, args) -> dict:
    """tokens/s, measured and simulated bubble of one schedule at m micro-batches."""
    from teratrain.parallel.pipeline.runtime import PipelineExecutor
    from teratrain.parallel.pipeline.simulate import bubble_fraction, simulate
    from teratrain.parallel.pipeline.timing import measured_costs

    v = 2 if schedule == "interleaved-1f1b" else 1
    cfg, rt, model, engine = build(base + [f"parallel.pp={args.pp}", f"parallel.schedule={schedule}",
                                           f"parallel.virtual_stages={v}", f"train.global_batch={m * args.mb}"])
    ex = PipelineExecutor(model, engine, rt, cfg, time_every_call=False)
    x, y = batches(cfg, m, rt.device)
    micro = list(zip(x.split(args.mb), y.split(args.mb)))
    step = lambda: ex(micro, cfg.memory.precision, 1e-4)  # noqa: E731
    wall(step, args.warmup, rt.device)
    step_s = wall(step, args.steps, rt.device)
    ex.time_every_call = True
    step()
    sched = ex.schedule(m)
    simulated = simulate(sched, measured_costs(ex.intervals, sched.pp, sched.num_stages)).bubble_fraction
    measured = bubble_fraction(ex.intervals, sched.pp)
    out = {"schedule": schedule, "m": m, "tokens_per_s": round(m * args.mb * cfg.model.seq_len / step_s, 1),
           "step_ms": round(step_s * 1e3, 2), "bubble_measured": round(measured, 4),
           "bubble_simulated": round(simulated, 4),
           "bubble_ratio": round(measured / simulated, 3) if simulated else None}
    _free(model, engine, ex)
    return out


def torch_interleaved(base: list[str], m: int, args) -> float:
    """tokens/s of torch.distributed.pipelining's ScheduleInterleaved1F1B on our interleaved stages."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from teratrain.memory.precision import autocast
    from teratrain.parallel.pipeline.stage import Chunk

    cfg, rt, model, engine = build(base + [f"parallel.pp={args.pp}", "parallel.schedule=interleaved-1f1b",
                                           "parallel.virtual_stages=2", f"train.global_batch={m * args.mb}"])
    layout = model.pipeline
    stages = [PipelineStage(TorchStage(Chunk(model, s, layout.num_stages, layout.bounds[s]), cfg), s, layout.num_stages,
                            rt.device, group=rt.group("pp")) for s in layout.stages]
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=lambda logits, y: model.criterion(logits, y))
    x, y = batches(cfg, m, rt.device)
    pp_rank = layout.rank
    kw = {"return_outputs": False} if "return_outputs" in inspect.signature(sched.step).parameters else {}

    def step():
        with autocast(cfg.memory.precision, rt.device):
            if pp_rank == 0:
                sched.step(x, **kw)
            elif pp_rank == layout.pp - 1:
                sched.step(target=y, **kw)
            else:
                sched.step(**kw)
        engine.end_backward()
        engine.step(1e-4)

    wall(step, args.warmup, rt.device)
    tps = m * args.mb * cfg.model.seq_len / wall(step, args.steps, rt.device)
    _free(model, engine, sched, stages)
    return tps


class TorchStage(nn.Module):
    """One of our chunks as the module torch's PipelineStage wants: tokens or hidden states in, hidden
    states or logits out (torch's schedule applies the loss itself)."""

    def __init__(self, chunk, cfg):
        super().__init__()
        m = chunk.model
        self.chunk, self.seq_len = chunk, cfg.model.seq_len
        self.parts = nn.ModuleList([chunk.blocks] + ([m.tok_embeddings] if chunk.is_first else [])
                                   + ([m.norm, m.output] if chunk.is_last else []))

    def forward(self, x):
        c, m = self.chunk, self.chunk.model
        h = c.embed(x) if c.is_first else x
        h = c.blocks(h, m.rope(0, self.seq_len) if m.rope is not None else None)
        return m.head(h) if c.is_last else h


def _free(*objs) -> None:
    import gc

    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker(args) -> None:
    args.pp = int(os.environ["WORLD_SIZE"])
    base = model_sets(args.pp, args.smoke)
    args.mb = 2
    ms = SMOKE_MICROBATCHES if args.smoke else MICROBATCHES
    rows = [ours(base, s, m, args) for s in SCHEDULES for m in ms]
    versus = []
    for m in ms:
        theirs = torch_interleaved(base, m, args)
        mine = next(r["tokens_per_s"] for r in rows if r["schedule"] == "interleaved-1f1b" and r["m"] == m)
        versus.append({"m": m, "ours_tokens_per_s": mine, "torch_tokens_per_s": round(theirs, 1),
                       "ratio": round(mine / theirs, 3)})
    if int(os.environ["RANK"]) == 0:
        result = {"bench": "pipeline", "pp": args.pp, "model": base, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "schedules": rows, "interleaved_vs_torch": versus}
        if args.parity_result:
            result["parity"] = json.loads(Path(args.parity_result).read_text())
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
    dist.barrier()
    dist.destroy_process_group()


def parity(n: int, smoke: bool, steps: int) -> list[dict]:
    """`teratrain train` at pp=n under three schedules against one process, step by step."""
    sets = (["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "train.device=cpu"]
            if smoke else ["model.preset=llama-1b", "model.vocab_size=32000", "model.n_layers=8",
                           "model.seq_len=2048", "memory.precision=bf16"])
    sets += [f"train.global_batch={4 * n}", "train.micro_batch=1", "train.eval_batches=0", "metrics.progress=false",
             "optim.warmup_steps=2"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        one = _train(1, sets, steps, Path(tmp) / "one")
        for schedule in ("1f1b", "interleaved-1f1b", "zb-h1"):
            v = 2 if schedule == "interleaved-1f1b" else 1
            many = _train(n, sets + [f"parallel.pp={n}", f"parallel.schedule={schedule}",
                                     f"parallel.virtual_stages={v}"], steps, Path(tmp) / schedule)
            err = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(many, one))
            out.append({"schedule": schedule, "pp": n, "steps": len(many), "max_rel_loss_diff": err,
                        "within_2e-2": err <= 2e-2, "final_loss": [many[-1]["loss"], one[-1]["loss"]]})
    return out


def _train(nproc: int, sets: list[str], steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "teratrain", "train", "--out", str(out), "--steps", str(steps), *[a for x in sets for a in ("--set", x)]]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--parity", action="store_true", help="also train 3 schedules against one GPU first")
    ap.add_argument("--parity-only", action="store_true", help="only the parity runs")
    ap.add_argument("--parity-result", help=argparse.SUPPRESS)  # from the launcher to the torchrun job
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = 1, 1
    if "WORLD_SIZE" in os.environ:
        worker(args)
        return
    n = 2 if args.smoke else torch.cuda.device_count()
    if n < 2:
        sys.exit("bench/pipeline.py needs at least 2 GPUs (or --smoke for CPU processes)")
    if args.parity_only:
        text = json.dumps({"bench": "pipeline", "pp": n, "parity": parity(n, args.smoke, 4 if args.smoke else 20)},
                          indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
        return
    passed = [a for a in sys.argv[1:] if a != "--parity"]
    if args.parity:  # the torchrun job puts it into its one JSON object
        found = Path(tempfile.mkdtemp()) / "parity.json"
        found.write_text(json.dumps(parity(n, args.smoke, 4 if args.smoke else 20)))
        passed += ["--parity-result", str(found)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__, *passed]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
