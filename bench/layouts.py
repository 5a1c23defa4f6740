"""The layout matrix: every strategy and every composition that fits the GPUs of one machine, each
against one GPU on the same global batch, under NCCL, in one command and one JSON.

    python bench/layouts.py --gpus 2 --tokens data.bin --out layouts.json
    python bench/layouts.py --smoke                   # 2 CPU processes over gloo, tiny shapes

For each layout: fp32 for `--fp32-steps` steps (TF32 off: every step's loss within 1e-4 relative of
one GPU's) and bf16 for `--bf16-steps` steps (within 2e-2), then bf16 tokens/s, MFU and the peak
memory of the fullest rank; `speedup_vs_one_gpu` against the eager one-GPU run, for eager layouts only
(a compiled layout's ratio against that eager run is named `speedup_vs_eager_one_gpu`). Asynchronous
schedules (pipedream, pipedream-2bw) compute another function than one GPU does: they are checked
against their own semantics instead (every forward and its backward use one weight version, versions
are the parameters a STEP left, never more held than the simulator says: versions.audit) and their
loss must fall.

Each model's one-GPU bf16 run is repeated twice: once as it was (`repeatable`: the same bits, which
needs every kernel to be deterministic; bench/determinism.py says which are not), once with every
step's micro-batches in reverse order (the same sum of gradients, rounded in another order). The wider
of the two drifts (`noise_floor`) is what bf16 rounding alone does to that model over `--bf16-steps`
steps, on one GPU, with no parallelism at all.

The tolerances are fixed before the run: a layout passes with fp32 within 1e-4 and bf16 within 2e-2,
whatever the floor. The floor is recorded beside each row, and a failing row carries its `reason`. The
dense model's floor is ~1e-3. The MoE model's was 2.4e-2 to 3.3e-2 per step on an H200: top-2 routing turns
a last-bit difference (cuDNN attention's nondeterministic backward, another summation order) into other
experts for some tokens, and the runs part, so a per-step bound cannot tell a correct layout from one GPU
rerun. MoE rows are therefore judged in bf16 on the learning curve instead: the mean loss over the last
half of the bf16 steps (10 of 20) within 1% (MOE_BF16_TOL) of one GPU's, with train.deterministic on both
sides (it takes cuDNN attention's run-to-run differences out; bench/determinism.py). The 1%: one GPU
against itself moved 2.6e-2 on its worst step; differences that change sign from step to step shrink
about sqrt(10)-fold in a mean of 10 (2.6e-2 / sqrt(10) = 8e-3), rounded up to 1%. The per-step drift
and the same mean's floor (one GPU against itself) are recorded beside the row; the fp32 check (1e-4 per
step) still holds every MoE layout to one GPU's arithmetic.

Two MoE models: 8 experts top-2 (`moe`), and the MoE of recent models (`moe-fine`, rows named `*-fine`): the
same expert parameters as 32 narrow experts, top-4, a gated shared expert, sigmoid scores and DeepSeek-V3's
auxiliary-loss-free bias, which `_train` moves after every step as `teratrain train` does. Both are judged as
above. A bias left unmoved shifts the fp32 losses of `--smoke` by 1.6e-5 in 5 steps, inside 1e-4, so each fp32
row also records how far its biases lie from one GPU's (`fp32_bias_max_diff`: 0 unless a token chose otherwise
somewhere; not judged).

FP8 rows (`memory.fp8=tensorwise`, the `fp8` model) train in bf16 only: float8 GEMMs run inside bf16
training, so there is no fp32 run. They are checked against one GPU training in fp8, within the same
fixed bf16 tolerance (a tensor-parallel rank scales its own weight shard, so its float8 roundings differ
from one GPU's; tests/dist/test_fp8.py bounds that on CPU). They need GPUs of compute capability 8.9 or
higher (`--smoke` emulates the float8 GEMMs).

Every layout runs in the same worker processes (one torchrun job: starting a job per layout would
cost more than the runs), through what `teratrain train` runs each step: `parallelize` and the
step runner (`train_step`, or the pipeline executor), fed by the trainer's `Batches` from a token
file (`--tokens`, uint16 ids below the vocabulary, e.g. written by `teratrain train`'s data cache);
the one-GPU reference runs on every rank's own GPU as a world of one. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import in_job, job_env  # noqa: E402
from layout_verdicts import (BF16_TOL, BLOCK_BYTES_TOL, FP32_TOL, MOE_BF16_TOL, max_rel, parity_ok,  # noqa: E402,F401
                             parity_reason, table, tail, tail_rel)

MOE_MODELS = ("moe", "moe-cp", "moe-fine")  # judged as MOE_BF16_TOL says
# llama-1b width, 8 layers, 32k vocabulary; global batch 8 in micro-batches of 2
MODEL = ["model.preset=llama-1b", "model.vocab_size=32000", "model.n_layers=8", "model.seq_len=2048"]
SMOKE = ["model.preset=llama-1b", "model.n_layers=8", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4",
         "model.d_ff=128", "model.vocab_size=512", "model.seq_len=32"]
SMALL = ["model.preset=llama-1b", "model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=4",
         "model.d_ff=512", "model.vocab_size=1024", "model.seq_len=128"]  # --small: tests/gpu, seconds per layout
COMMON = ["train.global_batch=8", "train.micro_batch=2", "optim.lr=1e-4", "optim.warmup_steps=3",
          "optim.schedule=constant", "train.eval_batches=0"]
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.capacity_factor=0"]
MOE_SMOKE_WIDTH = ["model.d_ff=64"]
MOE_WIDTH = ["model.d_ff=2816"]  # 8 experts of width 2816, top-2 (bench/moe.py's shape)
# the MoE of recent models (docs/moe.md): the 8 experts each cut in 4 (DeepSeek-MoE's fine-grained segmentation,
# the same expert parameters), top-4, one shared expert of the same width gated by sigmoid(x w_g) (Qwen2-MoE: the
# gate is a replicated (d_model -> 1) weight beside tp's split ones), sigmoid scores with the chosen 4 normalized
# and the aux-loss-free bias (DeepSeek-V3), which every step moves by the load over the whole global batch
MOE_FINE = ["model.moe.num_experts=32", "model.moe.top_k=4", "model.moe.capacity_factor=0",
            "model.moe.shared_experts=1", "model.moe.shared_gate=true", "model.moe.score=sigmoid",
            "model.moe.norm_topk=true", "model.moe.balance=bias"]
MOE_FINE_SMOKE_WIDTH = [*MOE_SMOKE_WIDTH, "model.moe.expert_d_ff=16"]
MOE_FINE_WIDTH = [*MOE_WIDTH, "model.moe.expert_d_ff=704"]  # 32 x 704 = 8 x 2816
# models besides dense and moe, each with its own one-GPU reference: a tied embedding (at pp > 1 its
# ZeRO-3 gather spans both end stages), int8 activation compression (it changes the math)
MODELS = {"tied": ["model.tie_embeddings=true"], "int8": ["memory.compress_activations=int8"],
          # the block linears' GEMMs in float8 (memory/fp8.py): bf16 only, against one GPU in fp8
          "fp8": ["memory.fp8=tensorwise"]}
# context parallelism with experts: each cp rank routes its own chunks, so the aux loss (a function of
# the tokens routed together) is left out for parity with one GPU (docs/context.md)
CP_MOE = ["model.moe.aux_loss_weight=0"]


def layouts(gpus: int) -> list[dict]:
    """(name, overrides, model, check) of every layout that fits `gpus` GPUs: every single strategy at
    degree `gpus`, then at 2 the pipeline's compositions inside one stage pair, at 4 the pairs and triples.
    `model`: dense, moe, or one of MODELS; `check`: parity or async."""
    def L(name, sets, model="dense", check="parity"):
        return {"name": name, "sets": sets, "model": model, "check": check}

    n = gpus
    pp = lambda s, *more, p=2: [f"parallel.pp={p}", f"parallel.schedule={s}", *more]  # noqa: E731
    inter = ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2"]
    singles = [L(f"dp{n}-zero{z}", [f"parallel.zero={z}"]) for z in range(4)] + [
        # compiled block by block (train.compile_scope=auto at dp > 1); ZeRO-3's hooks eager around each block
        L(f"dp{n}-compile", ["train.compile=true"]),
        L(f"dp{n}-zero3-compile", ["parallel.zero=3", "train.compile=true"]),
        # the CPU optimizer on its host threads (parallel.offload_threads), the masters and moments in
        # pinned host memory; offload=params keeps the parameter shards there too
        L(f"dp{n}-zero2-offload", ["parallel.zero=2", "parallel.offload=optimizer"]),
        L(f"dp{n}-zero3-offload-params", ["parallel.zero=3", "parallel.offload=params"]),
        L(f"tp{n}-megatron-sp", [f"parallel.tp={n}"]),
        L(f"tp{n}-megatron", [f"parallel.tp={n}", "parallel.sequence_parallel=false"]),
        L(f"tp{n}-megatron-sp-overlap", [f"parallel.tp={n}", "parallel.tp_overlap=chunked"]),
        L(f"tp{n}-all-gather", [f"parallel.tp={n}", "parallel.tp_form=all-gather"]),
        L(f"tp{n}-all-reduce", [f"parallel.tp={n}", "parallel.tp_form=all-reduce"]),
        # the per-op policy (GEMM outputs kept, the rest recomputed) on tensor-parallel shards
        L(f"tp{n}-megatron-sp-selective-ops", [f"parallel.tp={n}", "memory.recompute=selective-ops"]),
        *[L(f"pp{n}-{s}", pp(s, p=n)) for s in ("naive", "gpipe", "1f1b", "zb-h1")],
        L(f"pp{n}-interleaved", [f"parallel.pp={n}", *inter]),
        L(f"pp{n}-pipedream", pp("pipedream", p=n), check="async"),
        L(f"pp{n}-pipedream-2bw", pp("pipedream-2bw", p=n), check="async"),
        L(f"ep{n}", [f"parallel.ep={n}"], "moe"),
        L(f"ep{n}-fine", [f"parallel.ep={n}"], "moe-fine"),  # 32 / ep experts a rank
        # FP8 (bf16 only: no fp32 run to compare), data parallel, ZeRO-3 (bf16 gathers, cast after), tp
        L(f"dp{n}-fp8", [], "fp8", "parity-bf16"),
        L(f"dp{n}-zero3-fp8-compile", ["parallel.zero=3", "train.compile=true"], "fp8", "parity-bf16"),
        L(f"tp{n}-fp8", [f"parallel.tp={n}"], "fp8", "parity-bf16"),
    ]
    if gpus == 2:
        return singles + [
            L("pp2-interleaved-uneven", ["parallel.pp=2", *inter, "parallel.stage_layers=[1, 3, 2, 2]"]),
            # an end stage with no block: the embedding alone on the first, the head and loss alone on the last
            L("pp2-1f1b-first-empty", pp("1f1b", "parallel.stage_layers=[0, 8]")),
            L("pp2-zb-h1-last-empty", pp("zb-h1", "parallel.stage_layers=[8, 0]")),
            L("pp2-interleaved-ends-empty", ["parallel.pp=2", *inter, "parallel.stage_layers=[0, 4, 4, 0]"]),
            L("cp2", ["parallel.cp=2"]),  # ring attention, keys and values around the 2 ranks
            L("cp2-all-to-all", ["parallel.cp=2", "parallel.cp_form=all-to-all"]),
            L("pp2-1f1b-zero1", pp("1f1b", "parallel.zero=1")),  # the tied embedding's group spans both stages
            L("pp2-1f1b-zero2", pp("1f1b", "parallel.zero=2")),
            # at dp=1 ZeRO-3 shards only the tied embedding, over both end stages: the cross-stage gather
            L("pp2-1f1b-zero3-tied", pp("1f1b", "parallel.zero=3"), "tied"),
            L("pp2-1f1b-compile", pp("1f1b", "train.compile=true")),  # per block
            L("pp2-1f1b-int8", pp("1f1b", "memory.compress_activations=int8"), "int8"),
            L("ep2-zero1", ["parallel.ep=2", "parallel.zero=1"], "moe"),
            L("pp2-1f1b-fp8", pp("1f1b"), "fp8", "parity-bf16"),
        ]
    return singles + [
        *[L(f"tp2-dp2-zero{z}", ["parallel.tp=2", f"parallel.zero={z}"]) for z in (0, 1, 3)],
        # pp=2 x dp=2 with ZeRO: a tied embedding's 4-rank group spans both stages (a hang risk the matrix checks)
        *[L(f"pp2-dp2-zero{z}", pp("1f1b", f"parallel.zero={z}")) for z in (0, 1, 2, 3)],
        L("pp2-dp2-zero1-tied", pp("1f1b", "parallel.zero=1"), "tied"),
        L("pp2-dp2-zb-h1", pp("zb-h1", "parallel.zero=1")),
        L("pp2-dp2-interleaved", ["parallel.pp=2", *inter, "parallel.zero=1"]),
        L("tp2-pp2-1f1b", pp("1f1b", "parallel.tp=2")),  # tp collectives inside each stage, between p2p sends
        L("tp2-pp2-interleaved", ["parallel.pp=2", "parallel.tp=2", *inter]),
        L("tp2-pp2-zb-h1", pp("zb-h1", "parallel.tp=2")),
        L("pp4-1f1b-ends-empty", pp("1f1b", "parallel.stage_layers=[0, 4, 4, 0]", p=4)),
        L("tp2-pp2-1f1b-first-empty", pp("1f1b", "parallel.tp=2", "parallel.stage_layers=[0, 8]")),
        L("tp2-dp2-zero3-selective-ops", ["parallel.tp=2", "parallel.zero=3", "memory.recompute=selective-ops"]),
        # without sequence parallelism each tp rank sends 1/tp of a message; the receiver all-gathers over tp
        L("tp2-pp2-1f1b-scatter", pp("1f1b", "parallel.tp=2", "parallel.sequence_parallel=false")),
        L("ep2-tp2", ["parallel.ep=2", "parallel.tp=2"], "moe"),
        L("ep2-dp2-zero1", ["parallel.ep=2", "parallel.zero=1"], "moe"),  # experts in 2 shards, each on 2 ranks
        L("pp2-ep2", pp("1f1b", "parallel.ep=2"), "moe"),  # the all-to-all among each stage's dp ranks
        # the fine-grained model: tp splits the routed and the shared experts' width; each stage moves its own
        # layers' biases; ZeRO-1 shards the expert states over the ranks holding the same 16 experts
        L("ep2-tp2-fine", ["parallel.ep=2", "parallel.tp=2"], "moe-fine"),
        L("ep2-dp2-zero1-fine", ["parallel.ep=2", "parallel.zero=1"], "moe-fine"),
        L("pp2-ep2-fine", pp("1f1b", "parallel.ep=2"), "moe-fine"),
        L("cp4", ["parallel.cp=4"]), L("cp4-all-to-all", ["parallel.cp=4", "parallel.cp_form=all-to-all"]),
        L("dp2-cp2-zero3", ["parallel.cp=2", "parallel.zero=3"]),  # ZeRO-3 sharded over dp x cp
        L("tp2-cp2", ["parallel.cp=2", "parallel.tp=2"]),  # sequence parallelism inside each cp rank's chunks
        L("pp2-cp2", pp("1f1b", "parallel.cp=2")),
        L("ep2-cp2", ["parallel.cp=2", "parallel.ep=2"], "moe-cp"),
        L("tp2-dp2-zero1-fp8", ["parallel.tp=2", "parallel.zero=1"], "fp8", "parity-bf16"),
        L("pp2-dp2-fp8", pp("1f1b", "parallel.zero=1"), "fp8", "parity-bf16"),
    ]


# ---------------------------------------------------------------- worker (one per rank, under torchrun)

@functools.lru_cache(maxsize=4)
def _token_file(path: str | None, vocab: int):
    import numpy as np

    if path:
        return np.memmap(path, dtype=np.uint16, mode="r")
    # a learnable synthetic text (smoke runs): each token is 7 * previous + 3 mod V, with 1% noise
    g = np.random.default_rng(0)
    x = np.empty(200_000, dtype=np.int64)
    x[0] = 1
    noise = g.random(len(x)) < 0.01
    for i in range(1, len(x)):
        x[i] = g.integers(vocab) if noise[i] else (7 * x[i - 1] + 3) % vocab
    return x.astype(np.uint16)


def _config(args, layout: dict, precision: str):
    from teratrain.config import load_config

    base, tiny = SMOKE if args.smoke else SMALL if args.small else MODEL, args.smoke or args.small
    eight = MOE + (MOE_SMOKE_WIDTH if tiny else MOE_WIDTH)
    moe = {"moe": eight, "moe-cp": eight, "moe-fine": MOE_FINE + (MOE_FINE_SMOKE_WIDTH if tiny else MOE_FINE_WIDTH)}
    device = ["train.device=cpu"] if args.smoke else []
    if layout["model"] == "fp8" and args.smoke:  # no float8 tensor cores on a CPU: torchao's emulation
        device.append("memory.fp8_emulate=true")
    deterministic = ["train.deterministic=true"] if layout["model"] in MOE_MODELS else []  # both sides
    model = moe.get(layout["model"], []) + {**MODELS, "moe-cp": CP_MOE}.get(layout["model"], [])
    return load_config(None, base + COMMON + model + device + deterministic + [f"memory.precision={precision}"]
                       + layout["sets"])


def _train(cfg, rt, tokens, steps: int, audit: bool = False, reverse: bool = False) -> dict:
    """`steps` optimizer steps of the trainer's step path on this layout, each followed by the MoE statistics
    that move an expert bias; every step's loss (mean over data-parallel ranks), the step times, the peak
    memory of the fullest rank, the expert biases at the end (balance=bias). `reverse`: each step's
    micro-batches in the opposite order (the same sum, rounded in another order: the noise floor)."""
    import torch

    from teratrain import moe_metrics
    from teratrain.checkpoint.state import deterministic_algorithms, seed_everything
    from teratrain.collector import Collector
    from teratrain.data.loader import Batches
    from teratrain.measure import build_engine
    from teratrain.models.protocol import model_flops_per_token
    from teratrain.optim.lr import lr_at
    from teratrain.parallel.comm import AVG, MAX, all_reduce
    from teratrain.parallel.pipeline.runtime import PipelineExecutor, step_runner

    seed_everything(cfg.train.seed + rt.dp_rank)
    deterministic_algorithms(cfg.train.deterministic)  # as `teratrain train` sets it; off again for the next run
    model, engine = build_engine(cfg, rt=rt)
    if audit:
        run_step = PipelineExecutor(model, engine, rt, cfg, audit=True)
        rt.mesh.connect(rt.device)
    else:
        run_step = step_runner(model, engine, rt, cfg)
    tc, dev = cfg.train, rt.device
    moves_bias = cfg.model.moe.enabled and cfg.model.moe.balance == "bias"
    batches = Batches(tokens, cfg.model.seq_len, tc.seed, tc.global_batch)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    with Collector(tc.gc_every) as collector:  # the garbage collector as `teratrain train` runs it
        for step in range(steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, steps, cfg.optim.schedule, cfg.optim.min_lr_ratio)
            micro = list(batches.micro_batches(step, rt.dp_rank, rt.dims.dp, tc.micro_batch, dev))
            micro = micro[::-1] if reverse else micro
            _, loss = run_step(micro, cfg.memory.precision, lr)
            if moves_bias:  # as train.py after each step: it moves balance=bias routers' bias (a dp all-reduce)
                moe_metrics.step_metrics(model, rt)
            loss = loss.detach().float().clone()
            all_reduce(loss, rt.dp_group, op=AVG)
            losses.append(float(loss))  # synchronizes
            times.append(time.perf_counter() - t0)
            collector.step()
    peak = torch.tensor([float(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else 0.0], device=dev)
    all_reduce(peak, rt.group("world"), op=MAX)
    out = {"losses": losses, "times": times, "peak_gib": float(peak) / 2**30,
           "flops_per_token": model_flops_per_token(model, cfg.model), "tokens_per_step": tc.global_batch * cfg.model.seq_len}
    if audit:
        from teratrain.parallel.pipeline.simulate import peak_versions
        from teratrain.parallel.pipeline.versions import audit as audit_versions

        acts = run_step.schedule(len(micro)).ranks[run_step.rank]
        out["audit"] = audit_versions(run_step.records, peak_versions(acts))
    if moves_bias:
        out["expert_bias"] = _expert_bias(model, rt)
    del run_step, engine, model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    return out


def _expert_bias(model, rt) -> dict[str, list[float]]:
    """Each balance=bias router's expert bias by global layer key, every pipeline stage's (collective over pp).
    The bias moves by the load counts alone (a sign), so in fp32 a layout holds one GPU's exactly unless a
    token's choice differs somewhere; the losses barely show a bias left unmoved (module docstring)."""
    from teratrain.models.moe import expert_biases
    from teratrain.parallel.comm import all_gather_objects

    own = expert_biases(model)
    parts = all_gather_objects(own, rt.group("pp")) if rt.dims.pp > 1 else [own]
    return {key: bias for part in parts for key, bias in part.items()}


def _bias_diff(a: dict, b: dict) -> float:
    """The largest difference between two runs' expert biases (inf where they hold other layers)."""
    if a.keys() != b.keys():
        return math.inf
    return max((abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True)), default=0.0)


_MESHES: dict = {}  # one runtime per layout shape: its groups (and their NCCL communicators) are reused


def _runtime(cfg, single: bool):
    from teratrain.mesh import ParallelDims, Runtime, init_runtime, pick_device

    if single:  # the one-GPU reference: a world of one on this rank's own device
        return Runtime.single(pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0"))))
    dims = ParallelDims.from_config(cfg.parallel, int(os.environ["WORLD_SIZE"]))
    if dims not in _MESHES:
        _MESHES[dims] = init_runtime(cfg)
    cfg.parallel.dp = dims.dp
    return _MESHES[dims]


def _block_bytes(args, layout: dict, world: int) -> dict:
    """One block's bytes kept from forward to backward in bf16, one micro-batch: what one more block leaves
    alive (measure.live_bytes of the layout at 2 blocks less 1; the most of any rank), and the planner's count
    of the same (planner.memory.forward_saved): on the row's GPUs, what sequence parallelism's kept input
    shards and the recompute policies save."""
    import torch

    from teratrain.data.loader import Batches
    from teratrain.measure import build_engine, live_bytes
    from teratrain.parallel.comm import MAX, all_reduce
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import forward_saved

    got, planned = [], []
    for n in (1, 2):
        cfg = _config(args, {**layout, "sets": [*layout["sets"], f"model.n_layers={n}"]}, "bf16")
        rt = _runtime(cfg, False)
        model, _ = build_engine(cfg, rt=rt)
        tc = cfg.train
        batches = Batches(_token_file(args.tokens, cfg.model.vocab_size), cfg.model.seq_len, tc.seed, tc.global_batch)
        x, y = next(batches.micro_batches(0, rt.dp_rank, rt.dims.dp, tc.micro_batch, rt.device))
        try:  # a rank that fails outside a collective (e.g. out of memory) still joins the all-reduce below
            held, why = live_bytes(model, x, y, "bf16"), ""
        except Exception as e:  # noqa: BLE001
            held, why = 0, f"{type(e).__name__}: {e}"
        both = torch.tensor([held, int(bool(why))], dtype=torch.int64, device=rt.device)
        all_reduce(both, rt.group("world"), op=MAX)  # every rank: the most bytes, and whether any failed
        if both[1]:
            raise RuntimeError(why or "another rank failed to count its block")
        got.append(int(both[0]))
        planned.append(forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, world), rt.device.type))
        del model
    measured, plan = got[1] - got[0], planned[1] - planned[0]
    return {"block_bytes": measured, "block_bytes_planned": plan,
            "block_bytes_ok": abs(measured - plan) <= BLOCK_BYTES_TOL * plan}


def _counts_blocks(layout: dict) -> bool:
    """Rows `_block_bytes` measures: the dense model's rows of tensor parallelism alone."""
    keys = {s.split("=")[0] for s in layout["sets"]}
    return layout["model"] == "dense" and "parallel.tp" in keys \
        and not keys & {"parallel.pp", "parallel.dp", "parallel.cp", "parallel.ep", "parallel.zero"}


def _summary(layout: dict, fp32: dict | None, bf16: dict, refs: dict, world: int, args) -> dict:
    import torch

    from teratrain.metrics import peak_flops

    warm = min(3, len(bf16["times"]) - 1)
    step_s = statistics.median(bf16["times"][warm:])
    tps = bf16["tokens_per_step"] / step_s
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = peak_flops(dev, "bf16", None)
    row = {"name": layout["name"], "sets": layout["sets"], "gpus": world, "check": layout["check"],
           "bf16_losses": bf16["losses"], "tokens_per_s": round(tps, 1), "step_ms": round(step_s * 1e3, 2),
           "mfu": round(bf16["flops_per_token"] * tps / (peak * world), 4) if peak else None,
           "peak_gib": round(bf16["peak_gib"], 2)}
    ref16 = refs[(layout["model"], "bf16")]
    row["one_gpu_tokens_per_s"] = ref16["tokens_per_s"]  # eager
    row["mode"] = "compiled" if "train.compile=true" in layout["sets"] else "eager"
    ratio = "speedup_vs_one_gpu" if row["mode"] == "eager" else "speedup_vs_eager_one_gpu"
    row[ratio] = round(tps / ref16["tokens_per_s"], 3)
    if layout["check"] in ("parity", "parity-bf16"):
        row.update(bf16_ref=ref16["losses"], bf16_rel_err=max_rel(bf16["losses"], ref16["losses"]))
        if fp32 is not None:
            ref32 = refs[(layout["model"], "fp32")]
            row.update(fp32_losses=fp32["losses"], fp32_ref=ref32["losses"],
                       fp32_rel_err=max_rel(fp32["losses"], ref32["losses"]))
            if "expert_bias" in ref32:  # recorded, not judged: the losses are (module docstring)
                row.update(fp32_bias_max_diff=_bias_diff(fp32.get("expert_bias", {}), ref32["expert_bias"]),
                           fp32_bias_max_one_gpu=max(abs(x) for b in ref32["expert_bias"].values() for x in b))
        row["bf16_noise_floor"] = ref16["noise_floor"]
        row["bf16_tol"] = BF16_TOL
        if layout["model"] in MOE_MODELS:  # judged on the learning curve (module docstring)
            row.update(bf16_check="tail-mean", bf16_tail_rel_err=tail_rel(bf16["losses"], ref16["losses"]),
                       bf16_tail_noise_floor=ref16["tail_noise_floor"], bf16_tol=MOE_BF16_TOL)
        row["ok"] = parity_ok(row)
        if not row["ok"]:
            row["reason"] = parity_reason(row)
    else:
        losses = bf16["losses"]
        row["audit"] = bf16["audit"]
        row["loss_fell"] = statistics.mean(losses[-3:]) < losses[0]
        row["ok"] = not bf16["audit"] and row["loss_fell"] and all(map(math.isfinite, losses))
    return row


def worker(args) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 arithmetic
    torch.backends.cudnn.allow_tf32 = False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    todo = [lay for lay in layouts(world) if not args.only or lay["name"] in args.only.split(",")]
    refs: dict = {}
    for model in sorted({lay["model"] for lay in todo}):
        for precision, steps in (("fp32", args.fp32_steps), ("bf16", args.bf16_steps)):
            if model == "fp8" and precision == "fp32":  # float8 GEMMs run inside bf16 training only
                continue
            cfg = _config(args, {"sets": [], "model": model}, precision)
            t0 = time.perf_counter()
            res = _train(cfg, _runtime(cfg, single=True), _token_file(args.tokens, cfg.model.vocab_size), steps)
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            warm = min(3, len(res["times"]) - 1)
            refs[(model, precision)] = {**res, "tokens_per_s": res["tokens_per_step"] / statistics.median(res["times"][warm:])}
            if precision == "bf16":  # how far one GPU drifts from itself when only the rounding changes
                refs[(model, precision)].update(_noise_floor(cfg, args, steps, res["losses"]))
            _say(rank, f"one GPU, {model} {precision} ({res['wall_s']} s): losses {[round(x, 4) for x in res['losses']]}"
                       + (f", noise floor {refs[(model, precision)]['noise_floor']:.1e}" if precision == "bf16" else ""))
    rows = []
    for lay in todo:
        t0 = time.perf_counter()
        try:
            fp32 = None
            if lay["check"] == "parity":
                cfg = _config(args, lay, "fp32")
                fp32 = _train(cfg, _runtime(cfg, False), _token_file(args.tokens, cfg.model.vocab_size), args.fp32_steps)
            cfg = _config(args, lay, "bf16")
            bf16 = _train(cfg, _runtime(cfg, False), _token_file(args.tokens, cfg.model.vocab_size), args.bf16_steps,
                          audit=lay["check"] == "async")
            row = _summary(lay, fp32, bf16, refs, world, args)
            if _counts_blocks(lay):
                try:
                    row.update(_block_bytes(args, lay, world))
                except Exception as e:  # noqa: BLE001 - the row's parity stands; the count fails on its own
                    row.update(block_bytes_ok=False, block_bytes_error=f"{type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - a refused or failing layout is a row of the matrix, not the end
            row = {"name": lay["name"], "sets": lay["sets"], "gpus": world, "ok": False,
                   "error": f"{type(e).__name__}: {e}"[:500]}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if rank == 0:  # after every layout: a run cut short still leaves what it measured
            _write(args.result, refs, rows, world, args)
        _say(rank, f"{row['name']} ({row['wall_s']} s): {'ok' if row['ok'] else 'FAILED'} "
                   + (f"fp32 {row.get('fp32_rel_err', 0):.1e} bf16 {row.get('bf16_rel_err', 0):.1e} "
                      f"{row.get('tokens_per_s')} tok/s" if "error" not in row else row["error"])
                   + (f", fp32 expert bias off by {row['fp32_bias_max_diff']:.1e} (one GPU's reaches "
                      f"{row['fp32_bias_max_one_gpu']:.1e})" if "fp32_bias_max_diff" in row else "")
                   + (f", one block keeps {row['block_bytes']:,} bytes (planned {row['block_bytes_planned']:,}"
                      + ("" if row["block_bytes_ok"] else ": off by more than 1%") + ")" if "block_bytes" in row
                      else f", block not counted: {row['block_bytes_error']}" if "block_bytes_error" in row else ""))


def _noise_floor(cfg, args, steps: int, losses: list[float]) -> dict:
    """One GPU against itself: the same run again (the same bits where every kernel is deterministic)
    and with each step's micro-batches reversed. The floor is the wider of the two drifts."""
    runs = {order: _train(cfg, _runtime(cfg, single=True), _token_file(args.tokens, cfg.model.vocab_size), steps,
                          reverse=order == "reversed")["losses"] for order in ("again", "reversed")}
    return {"noise_floor": max(max_rel(r, losses) for r in runs.values()), "repeatable": runs["again"] == losses,
            "floor_by_order": {order: max_rel(r, losses) for order, r in runs.items()},
            "tail_noise_floor": max(tail_rel(r, losses) for r in runs.values()),
            "losses_by_order": runs}


def _write(path: str, refs: dict, rows: list[dict], world: int, args) -> None:
    import torch

    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
            and not args.smoke else "cpu", "gpus": world, "model": _config(args, {"sets": [], "model": "dense"},
                                                                           "bf16").model.model_dump(),
            "common": COMMON, "moe": MOE, "moe_fine": MOE_FINE, "fp32_tol": FP32_TOL, "bf16_tol": BF16_TOL,
            "moe_bf16_tol": MOE_BF16_TOL,
            "one_gpu": {f"{m}-{p}": {"losses": r["losses"], "tokens_per_s": round(r["tokens_per_s"], 1),
                                     "peak_gib": round(r["peak_gib"], 2), "noise_floor": r.get("noise_floor"),
                                     "repeatable": r.get("repeatable"), "floor_by_order": r.get("floor_by_order"),
                                     "tail_noise_floor": r.get("tail_noise_floor"),
                                     "losses_by_order": r.get("losses_by_order")}
                        for (m, p), r in refs.items()}}
    Path(path).write_text(json.dumps({"info": info, "layouts": rows}, indent=1))


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[layouts] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- driver

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs (processes); default every visible GPU")
    ap.add_argument("--tokens", default=None, help="uint16 token file (real text); default a synthetic sequence")
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    ap.add_argument("--fp32-steps", type=int, default=5)
    ap.add_argument("--bf16-steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="2 CPU processes over gloo, tiny shapes")
    ap.add_argument("--small", action="store_true", help="small shapes on the GPUs (tests/gpu)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)  # worker: where rank 0 writes
    args = ap.parse_args()
    if "RANK" in os.environ:
        return in_job(worker, args)
    import torch

    gpus = args.gpus or (2 if args.smoke else torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(args.out).resolve() if args.out else Path(tmp) / "layouts.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               __file__, *sys.argv[1:], "--result", str(result)]
        env = job_env()
        if args.smoke:
            env["CUDA_VISIBLE_DEVICES"] = ""
        job = subprocess.run(cmd, env=env, cwd=ROOT)
        if not result.exists():
            sys.exit(f"bench/layouts.py: the job ended with status {job.returncode} before any layout finished")
        data = json.loads(result.read_text())
    print(json.dumps(data, indent=1))
    print(table(data["layouts"]), file=sys.stderr)
    sys.exit(0 if job.returncode == 0 and all(r["ok"] and r.get("block_bytes_ok", True) for r in data["layouts"])
             else 1)


if __name__ == "__main__":
    main()
