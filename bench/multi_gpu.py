"""Data parallelism and ZeRO on several GPUs of one host, under NCCL; prints one JSON object.

    python bench/multi_gpu.py --out multi_gpu.json                                 # parity + scaling, ~3 min on 2 GPUs
    python bench/multi_gpu.py --only offload --out multi_gpu_offload.json          # ~2-3 min
    python bench/multi_gpu.py --only fsdp2 --out fsdp2.json                        # bench/fsdp2_compare.py, ~2 min
    python bench/multi_gpu.py --smoke --only parity,scaling,offload,fsdp2          # 2 CPU processes over gloo

Every GPU of the machine (N >= 2) takes part. Layouts run one after another inside one torchrun job
per world size (bench/random_steps.py: the same random-token global batch at every layout), so the
default needs two jobs: N processes, then one.
1. parity:  llama-1b shape (32k vocab, seq 2048), bf16, 10 steps, ZeRO 0-3 on N GPUs vs 1 GPU on the
            same global batch (the 1-GPU run accumulates N micro-batches of 2). bf16 tolerance: every
            step's loss within 2e-2 relative (8 mantissa bits; the reduction order differs).
2. scaling: weak scaling (the same micro-batch per GPU) of ZeRO-1, 2 and 3 on llama-1b (micro-batch 4) and of
            ZeRO-3 on Llama-8B blocks (seq 4096, micro-batch 1; as many blocks as one GPU holds at
            ZeRO-3, planned, so the 1-GPU baseline runs): tokens/s per GPU at N over 1 GPU (target
            >= 0.95), and at N with `parallel.overlap_comm=false`, which shows what overlapping the
            reductions with backward saves.
3. fsdp2:   bench/fsdp2_compare.py: our ZeRO-3 against PyTorch FSDP2 on the same model and batch.
4. offload: ZeRO-3 with `parallel.offload=optimizer` (full recompute, seq 2048) on a stack of Llama-8B
            blocks one block deeper than ZeRO-3 without offload fits on the N GPUs (planned), or as deep
            as 70% of host memory holds at 12 bytes/param of masters and moments, or 48 blocks (time),
            whichever is smallest; 3 steps: tokens/s, peak GPU memory, and whether the plan says it
            fits without offload (2 x H100: 40 blocks, 9.0B parameters, which it does not).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import in_job, torchrun  # noqa: E402

LLAMA_1B = ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048"]
LLAMA_8B = ["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=512",
         "train.device=cpu"]
COMMON = ["memory.precision=bf16", "optim.warmup_steps=0", "optim.lr=3e-4"]
PARITY_TOL = 2e-2
BLOCK_PARAMS = 218_112_000  # a Llama-8B block (d 4096, d_ff 14336, 8 KV heads)
OFFLOAD_MAX_LAYERS = 48  # 10.5B parameters: building the host state and 3 CPU AdamW steps stay ~3 min


def run_layouts(nproc: int, runs: list[dict], work: Path, tag: str) -> dict:
    """Each run ({"name", "sets", "steps"}) in one torchrun job of nproc processes; name -> summary."""
    spec = work / f"{tag}.runs.json"
    spec.write_text(json.dumps(runs))
    torchrun(__file__, nproc, ["--phase", str(spec), "--result", str(work / f"{tag}.json")], timeout_s=1800)
    return json.loads((work / f"{tag}.json").read_text())


def phase(spec: str, result: str) -> None:
    """Under torchrun: every run of the spec, one after another; rank 0 writes the summaries."""
    from random_steps import Run

    out = {}
    for r in json.loads(Path(spec).read_text()):
        run = Run(r["sets"])
        out[r["name"]] = run.summary(run.steps(0, r["steps"]), skip=r.get("skip", 3))
        run.close()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(result).write_text(json.dumps(out))


def parity_runs(n: int, model: list[str], steps: int) -> list[dict]:
    return [{"name": f"parity-zero{z}", "steps": steps,
             "sets": model + COMMON + [f"parallel.zero={z}", f"train.global_batch={2 * n}", "train.micro_batch=2"]}
            for z in range(4)]


def scaling_runs(n: int, models: dict, steps: int, many: bool) -> list[dict]:
    """`many`: the N-GPU runs (with and without overlap), else the 1-GPU baselines."""
    out = []
    for tag, (model, zero, mb) in models.items():
        sets = model + COMMON + [f"parallel.zero={zero}", f"train.micro_batch={mb}"]
        if many:
            out.append({"name": tag, "steps": steps, "sets": sets + [f"train.global_batch={mb * n}"]})
            out.append({"name": f"{tag}-serial", "steps": steps,
                        "sets": sets + [f"train.global_batch={mb * n}", "parallel.overlap_comm=false"]})
        else:
            out.append({"name": tag, "steps": steps, "sets": sets + [f"train.global_batch={mb}"]})
    return out


def parity_table(many: dict, one: dict) -> list[dict]:
    rows = []
    for z in range(4):
        a, b = many[f"parity-zero{z}"]["losses"], one[f"parity-zero{z}"]["losses"]
        err = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        rows.append({"zero": z, "max_rel_loss_diff": err, f"within_{PARITY_TOL}": err <= PARITY_TOL,
                     "final_loss": [a[-1], b[-1]]})
    return rows


def scaling_table(n: int, models: dict, many: dict, one: dict) -> list[dict]:
    rows = []
    for tag, (model, zero, mb) in models.items():
        per_gpu = many[tag]["tokens_per_s"] / n
        rows.append({"run": tag, "zero": zero, "micro_batch": mb, "shape": model, "gpus": n,
                     "tokens_per_s_per_gpu_1": one[tag]["tokens_per_s"], "tokens_per_s_per_gpu_n": per_gpu,
                     "weak_scaling_efficiency": per_gpu / one[tag]["tokens_per_s"],
                     "tokens_per_s_per_gpu_n_no_overlap": many[f"{tag}-serial"]["tokens_per_s"] / n,
                     "overlap_speedup": many[tag]["tokens_per_s"] / many[f"{tag}-serial"]["tokens_per_s"],
                     "peak_gib_1": one[tag]["peak_gib"], "peak_gib_n": many[tag]["peak_gib"]})
    return rows


def offload_sets(n: int, gpu_bytes: int | None) -> tuple[list[str], dict]:
    """Llama-8B blocks one deeper than ZeRO-3 fits on n GPUs without offload, capped by host memory."""
    from common import fit_layers

    run = ["memory.recompute=full", "train.micro_batch=1", f"train.global_batch={2 * n}", "parallel.zero=3"] + COMMON
    if gpu_bytes is None:  # smoke
        return SMOKE + run + ["parallel.offload=optimizer"], {"n_layers": 2}
    base = LLAMA_8B[:2] + ["model.seq_len=2048"] + run
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    by_host = int(0.7 * host / 12 / BLOCK_PARAMS)
    most = int(n * gpu_bytes / (16 * BLOCK_PARAMS)) + 1  # 16 bytes/param of model states over n GPUs
    try:
        beyond = fit_layers(base + [f"model.n_layers={most}"], n, gpu_bytes, fraction=1.0) + 1
    except SystemExit:
        beyond = 1
    layers = min(beyond, by_host, OFFLOAD_MAX_LAYERS)
    info = {"n_layers": layers, "layers_fitting_without_offload_planned": beyond - 1, "layers_host_holds": by_host,
            "fits_without_offload_planned": layers < beyond}
    return base + [f"model.n_layers={layers}", "parallel.offload=optimizer"], info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="parity,scaling", help="comma-separated: parity, scaling, fsdp2, offload")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        return in_job(phase, args.phase, args.result)
    import torch

    n = 2 if args.smoke else torch.cuda.device_count()
    if n < 2:
        sys.exit("bench/multi_gpu.py needs at least 2 GPUs (or --smoke for CPU processes)")
    from common import emit, fit_layers, gpu_memory_bytes

    gpu_bytes = None if args.smoke else gpu_memory_bytes()
    steps = 4 if args.smoke else args.steps
    only = args.only.split(",")
    result = {"bench": "multi_gpu", "gpus": n, "torch": torch.__version__,
              "gpu_memory_gib": gpu_bytes / 2**30 if gpu_bytes else None}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "parity" in only or "scaling" in only:
            model_1b = SMOKE if args.smoke else LLAMA_1B
            one_gpu = LLAMA_8B + COMMON + ["parallel.zero=3", "train.micro_batch=1", "train.global_batch=1"]
            layers = 2 if args.smoke else fit_layers(one_gpu, 1, gpu_bytes)
            model_8b = SMOKE if args.smoke else LLAMA_8B + [f"model.n_layers={layers}"]
            models = {**{f"zero{z}-llama1b": (model_1b, z, 4) for z in (1, 2, 3)},
                      f"zero3-llama8b-{layers}-blocks": (model_8b, 3, 1)}
            many, one = [], []
            if "scaling" in only:  # first: each layout's process groups stay (mesh.py), with NCCL's buffers
                many += scaling_runs(n, dict(reversed(models.items())), steps + 3, many=True)
                one += scaling_runs(n, models, steps + 3, many=False)
            if "parity" in only:
                many += parity_runs(n, model_1b, steps)
                one += parity_runs(n, model_1b, steps)
            got_many, got_one = run_layouts(n, many, work, "many"), run_layouts(1, one, work, "one")
            if "parity" in only:
                result["parity"] = parity_table(got_many, got_one)
            if "scaling" in only:
                result["scaling"] = scaling_table(n, models, got_many, got_one)
        if "fsdp2" in only:
            res = work / "fsdp2.json"
            smoke = ["--smoke"] if args.smoke else []
            torchrun(ROOT / "bench" / "fsdp2_compare.py", n, ["--out", str(res)] + smoke, timeout_s=1800)
            result["fsdp2"] = json.loads(res.read_text())
        if "offload" in only:
            sets, info = offload_sets(n, gpu_bytes)
            got = run_layouts(n, [{"name": "offload", "steps": 3, "skip": 1, "sets": sets}], work, "offload")["offload"]
            result["offload"] = {**info, "gpus": n, "tokens_per_s": got["tokens_per_s"], "peak_gib": got["peak_gib"],
                                 "step_s": got["step_s"], "model_state_bytes": got["model_state_bytes"]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
