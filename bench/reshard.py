"""Resharding checkpoints: a llama-1b run saved at (dp=N, ZeRO-3) resumes at (dp=1, ZeRO-1).

    python bench/reshard.py                  # every GPU of the machine saves (>= 2), then one GPU resumes: ~2 min on 2
    python bench/reshard.py --smoke          # 2 CPU processes over gloo, then 1, tiny shape, fp32

The micro-batch (4, else 2, else 1; global batch 8) is the largest at which the resuming layout is
planned to fit 75% of the GPU found. The checkpoint (fp32 masters and AdamW moments, 14.9 GB for
llama-1b) goes to a temporary folder (or under --work).

Two torchrun jobs on fixed random tokens (the same global batch at every layout):
1. save:   dp=N, parallel.zero=3, bf16 with fp32 masters; `--steps` steps, a timed logical checkpoint
           (every rank writes its shards: masters and Adam moments), then `--more` steps: the losses of
           the run that never changes layout.
2. resume: dp=M (default 1), parallel.zero=1; a timed restore (each rank reads just its slices; the
           time includes checking the files' sha256 digests, which is also reported alone), then the
           same `--more` steps.
Printed: both runs' continued losses and their worst relative difference (bf16 tolerance 2e-2 as in
multi_gpu.py; fp32 smoke 1e-5), checkpoint bytes, save and load seconds and GB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import in_job, torchrun  # noqa: E402

LLAMA_1B = ["model.preset=llama-1b", "model.vocab_size=32000", "memory.precision=bf16", "train.global_batch=8"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=32",
         "model.vocab_size=512", "train.micro_batch=2", "train.global_batch=8", "train.device=cpu"]
COMMON = ["optim.lr=3e-4", "optim.warmup_steps=0", "optim.schedule=constant", "checkpoint.keep=1"]


# ---------------------------------------------------------------- one job (under torchrun)

def phase(args) -> None:
    import torch

    from random_steps import Run
    from teratrain.checkpoint import io
    from teratrain.checkpoint.training import restore_training, save_training

    run = Run(json.loads(args.sets))
    cfg, rt, engine = run.cfg, run.rt, run.engine
    root, out = Path(args.work) / "checkpoints", {}

    def timed(fn):
        rt.barrier()
        t0 = time.perf_counter()
        result = fn()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        rt.barrier()
        return result, time.perf_counter() - t0

    if args.phase == "save":
        out["first_losses"] = run.steps(0, args.steps)["losses"]
        path, out["save_s"] = timed(lambda: save_training(root, args.steps, cfg, rt, engine))
        out["bytes"] = sum(f.stat().st_size for f in path.iterdir())
    else:
        start, out["load_s"] = timed(lambda: restore_training(root, cfg, rt, engine, Path(args.work)))
        assert start == args.steps, start
        path = root / (root / "latest").read_text().strip()
        _, out["digest_s"] = timed(lambda: io.verify(path, rt.rank, rt.world))  # the digest check alone
    out["losses"] = run.steps(args.steps, args.more)["losses"]
    out["layout"] = {"dp": rt.dims.dp, "zero": cfg.parallel.zero, "world": rt.world}
    out["peak_gib"] = run.summary({"step_s": [1.0]})["peak_gib"]
    if rt.is_main:
        Path(args.work, f"{args.phase}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------- the driver

def micro_batch(resume_gpus: int) -> int:
    """The largest of 4, 2, 1 at which the resuming layout (the fuller one: ZeRO-1 on fewer GPUs) is
    planned to fit 75% of the GPU found, so the run fits H100 (80 GB) and H200 (141 GB) alike."""
    from common import gpu_memory_bytes, planned_bytes

    gpu = gpu_memory_bytes()
    for mb in (4, 2):
        if planned_bytes(LLAMA_1B + COMMON + [f"train.micro_batch={mb}", "parallel.zero=1"], resume_gpus) <= 0.75 * gpu:
            return mb
    return 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gpus", type=int, default=None, help="processes of the saving run (default: every GPU)")
    ap.add_argument("--resume-gpus", type=int, default=1, help="processes of the resuming run")
    ap.add_argument("--steps", type=int, default=5, help="steps before the checkpoint")
    ap.add_argument("--more", type=int, default=5, help="steps after it, in both runs")
    ap.add_argument("--work", help="folder for the checkpoint (default: a temporary folder)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--phase", choices=["save", "resume"], help=argparse.SUPPRESS)
    ap.add_argument("--sets", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        return in_job(phase, args)
    import torch

    if args.smoke:
        shape, tol = SMOKE, 1e-5
    else:
        shape, tol = LLAMA_1B + [f"train.micro_batch={micro_batch(args.resume_gpus)}"], 2e-2
    n = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    if n < 2 and not args.smoke:
        raise SystemExit("bench/reshard.py needs at least 2 GPUs for the saving run (or --smoke)")
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        runs = {}
        for name, nproc, sets in (("save", n, ["parallel.zero=3"]), ("resume", args.resume_gpus, ["parallel.zero=1"])):
            torchrun(Path(__file__).resolve(), nproc, ["--phase", name, "--work", work, "--steps", str(args.steps), "--more", str(args.more),
                             "--sets", json.dumps(shape + COMMON + sets)])
            runs[name] = json.loads(Path(work, f"{name}.json").read_text())
    save, resume = runs["save"], runs["resume"]
    diff = max(abs(a - b) / abs(a) for a, b in zip(save["losses"], resume["losses"]))
    gb = save["bytes"] / 1e9
    result = {"bench": "reshard", "model": "smoke" if args.smoke else "llama-1b (32k vocab), bf16 + fp32 masters",
              "saved_at": save["layout"], "resumed_at": resume["layout"], "checkpoint_gb": round(gb, 3),
              "save_s": round(save["save_s"], 3), "save_gb_per_s": round(gb / save["save_s"], 3),
              "load_s": round(resume["load_s"], 3), "load_gb_per_s": round(gb / resume["load_s"], 3),
              "digest_check_s": round(resume["digest_s"], 3),
              "load_gb_per_s_without_digests": round(gb / max(resume["load_s"] - resume["digest_s"], 1e-9), 3),
              "losses_before": save["first_losses"], "losses_unchanged": save["losses"],
              "losses_resumed": resume["losses"], "max_rel_loss_diff": diff, "tolerance": tol, "ok": diff <= tol,
              "micro_batch": next(int(s.split("=")[1]) for s in shape if s.startswith("train.micro_batch")),
              "peak_gib": {"save": save["peak_gib"], "resume": resume["peak_gib"]},
              "torch": torch.__version__}
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
