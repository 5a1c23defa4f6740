"""Data parallelism and ZeRO on several GPUs of one host, under NCCL, in one call.

    python bench/multi_gpu.py                    # every GPU of the machine (needs >= 2)
    python bench/multi_gpu.py --smoke            # 2 CPU processes over gloo, tiny shapes: checks the script

Experiments (each a torchrun job; the driver prints one JSON object, the table goes to bench/README.md):
1. parity:  llama-1b shape (32k vocab), bf16, 20 steps, ZeRO 0-3 on N GPUs vs 1 GPU on the same global
            batch (the 1-GPU run accumulates N micro-batches). bf16 tolerance: every step's loss within
            2e-2 relative (bf16 keeps 8 mantissa bits; reduction order differs between the layouts).
2. scaling: weak scaling (same micro-batch per GPU) of ZeRO-1 on llama-1b and ZeRO-3 on llama-8b:
            tokens/s per GPU at N over 1 GPU (target >= 0.90), and at N with `parallel.overlap_comm`
            off, which shows what overlapping the reductions with backward saves.
3. fsdp2:   our ZeRO-3 against PyTorch FSDP2 (`fully_shard` per block + root, bf16 params, fp32
            reduce, fused AdamW) on the same model, shape and batch: tokens/s ratio and peak memory.
4. offload: the largest Llama-8B-block model that ZeRO-3 + `parallel.offload=optimizer` trains on N
            GPUs (sized from host memory: 12 bytes/param of masters + moments), with its tokens/s.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LLAMA_1B = ["model.preset=llama-1b", "model.vocab_size=32000"]
LLAMA_8B = ["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=4096"]
COMMON = ["memory.precision=bf16", "train.eval_batches=0", "metrics.progress=false", "optim.warmup_steps=5"]


def torchrun(nproc: int, args: list[str], timeout_s: int = 1800) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, env=env, timeout=timeout_s, cwd=ROOT)


def train(nproc: int, sets: list[str], steps: int, work: Path, name: str) -> list[dict]:
    """`teratrain train` on nproc processes; its metrics.jsonl records."""
    out = work / name
    args = ["-m", "teratrain", "train", "--out", str(out), "--steps", str(steps)]
    torchrun(nproc, args + [a for s in COMMON + sets for a in ("--set", s)])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tokens_per_s(rows: list[dict], skip: int = 3) -> float:
    return statistics.median(r["tokens_per_s"] for r in rows[skip:] or rows)


def parity(n: int, model: list[str], steps: int, work: Path) -> list[dict]:
    out = []
    for zero in range(4):
        sets = model + [f"parallel.zero={zero}", f"train.global_batch={2 * n}", "train.micro_batch=2"]
        many, one = train(n, sets, steps, work, f"par{zero}-{n}"), train(1, sets, steps, work, f"par{zero}-1")
        err = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(many, one))
        out.append({"zero": zero, "gpus": n, "max_rel_loss_diff": err, "within_2e-2": err <= 2e-2,
                    "final_loss": [many[-1]["loss"], one[-1]["loss"]]})
    return out


def scaling(n: int, model: list[str], zero: int, mb: int, steps: int, work: Path, tag: str) -> dict:
    sets = model + [f"parallel.zero={zero}", f"train.micro_batch={mb}"]
    one = train(1, sets + [f"train.global_batch={mb}"], steps, work, f"{tag}-1")
    many = train(n, sets + [f"train.global_batch={mb * n}"], steps, work, f"{tag}-{n}")
    serial = train(n, sets + [f"train.global_batch={mb * n}", "parallel.overlap_comm=false"], steps, work, f"{tag}-{n}-serial")
    per_gpu = tokens_per_s(many) / n
    return {"run": tag, "zero": zero, "gpus": n, "tokens_per_s_per_gpu_1": tokens_per_s(one), "tokens_per_s_per_gpu_n": per_gpu,
            "weak_scaling_efficiency": per_gpu / tokens_per_s(one), "tokens_per_s_per_gpu_n_no_overlap": tokens_per_s(serial) / n,
            "overlap_speedup": tokens_per_s(many) / tokens_per_s(serial),
            "peak_gib_n": max(r["peak_mem_bytes"] for r in many) / 2**30}


def offload(n: int, steps: int, work: Path, smoke: bool) -> dict:
    """Size the model from host memory (12 B/param of masters + moments, 80% of RAM), then train it."""
    if smoke:
        layers, sets = 2, SMOKE
    else:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        per_layer = 218_112_000  # a Llama-8B block (d 4096, d_ff 14336, 8 KV heads)
        layers = int(0.8 * host / 12 / per_layer)
        sets = LLAMA_8B[:2] + [f"model.n_layers={layers}", "model.seq_len=2048"]
    sets = sets + ["parallel.zero=3", "parallel.offload=optimizer", "memory.recompute=full",
                   "train.micro_batch=1", f"train.global_batch={4 * n}"]
    rows = train(n, sets, steps, work, "offload")
    return {"gpus": n, "n_layers": layers, "model_state_bytes": rows[0]["model_state_bytes"],
            "tokens_per_s": tokens_per_s(rows, skip=1), "peak_gib": max(r["peak_mem_bytes"] for r in rows) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="parity,scaling,fsdp2,offload")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    n = 2 if args.smoke else torch.cuda.device_count()
    if n < 2:
        sys.exit("bench/multi_gpu.py needs at least 2 GPUs (or --smoke for CPU processes)")
    model_1b, model_8b = (SMOKE, SMOKE) if args.smoke else (LLAMA_1B, LLAMA_8B)
    steps = 4 if args.smoke else args.steps
    result = {"bench": "multi_gpu", "gpus": n, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        only = args.only.split(",")
        if "parity" in only:
            result["parity"] = parity(n, model_1b, steps, work)
        if "scaling" in only:
            result["scaling"] = [scaling(n, model_1b, 1, 4, steps, work, "zero1-llama1b"),
                                 scaling(n, model_8b, 3, 1, steps, work, "zero3-llama8b")]
        if "fsdp2" in only:
            res = work / "fsdp2.json"
            torchrun(n, [__file__.replace("multi_gpu.py", "fsdp2_compare.py"), "--result", str(res)]
                     + (["--smoke"] if args.smoke else []))
            result["fsdp2"] = json.loads(res.read_text())
        if "offload" in only:
            result["offload"] = offload(n, min(steps, 4), work, args.smoke)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
