"""What memory.recompute=selective-ops replays in backward, and what that costs one rank.

selective-ops (memory/recompute.py) checkpoints each block with a per-op policy: the GEMMs' and fused
attention's outputs are kept, and backward reruns the block's forward for everything else (norms,
casts, RoPE, SiLU/GELU and the gating product, the first residual add; the checkpoint stops early, so
the block's last add, which backward needs nothing of, is not rerun). No FLOPs of the 6N count run
twice; what it costs is ops (launches and the host's issue time) and HBM traffic of memory-bound kernels.
Compiled (train.compile; the whole model is one graph, the only scope a per-op policy allows), inductor fuses
the replayed ops into the backward's kernels: planned as none of their own (`replay_ops`, `replay_s`;
one H100 ran llama-1b's compiled step in 138.0 ms with selective-ops and without recomputation alike).
"""

from __future__ import annotations

import math

from teratrain.config_schema import REPLAYING, SELECTIVE_OPS
from teratrain.planner.layout import Layout, ModelShape, Widths, block_linears
from teratrain.planner.states import rank_layers

# aten ops one block adds per micro-batch under selective-ops, (forward, backward), counted with a
# TorchDispatchMode over our Block as time.OPS_PER_BLOCK was (CPU, dropout 0; same columns), as the
# step's ops less those of recompute=none: the forward detaches each kept output (6 llama, 7 gpt2);
# backward reruns the replayed ops and detaches what it caches and restores (SILU_KEPT_OPS: the runs recorded
# while the dense SwiGLU kept silu's output). Of llama's 116 in fp32, most are detaches
# and other views: no kernel, host time alone. On CUDA an RMSNorm is one kernel
# (aten._fused_rms_norm) where the CPU count decomposes it into six ops: llama's count is the CPU's, as
# OPS_PER_BLOCK's is. tests/unit/test_planner_replay.py counts them again.
OPS_SELECTIVE_REPLAY = {("llama", "fp32"): (6, 116), ("llama", "autocast"): (6, 129), ("llama", "low"): (6, 120),
                        ("gpt2", "fp32"): (7, 74), ("gpt2", "autocast"): (7, 88), ("gpt2", "low"): (7, 74)}
# the same under selective-ops-alternate, counted so: 3 fewer outputs kept and detached in forward, the replayed
# products in backward (llama's wk, wo, w3; GPT-2's wk, wo: without dropout its replay stops before w2)
OPS_ALTERNATE_REPLAY = {("llama", "fp32"): (3, 119), ("llama", "autocast"): (3, 132), ("llama", "low"): (3, 123),
                        ("gpt2", "fp32"): (4, 76), ("gpt2", "autocast"): (4, 90), ("gpt2", "low"): (4, 76)}

# detaches one block adds per micro-batch when backward recomputes its forward (memory.recompute = full, every-k,
# sqrt: memory/recompute.py's non-reentrant checkpoints detach each tensor the rerun saves), counted with a
# TorchDispatchMode as OPS_SELECTIVE_REPLAY (the step's detaches less recompute=none's; the same in every
# precision). No kernel: the host's time alone (time.host_s). The rerun's other ops are charged as the forward's
# (time.OPS_PER_BLOCK; counted, 3-10 fewer a block). tests/unit/test_planner_replay.py counts both.
FULL_REPLAY_DETACHES = {"llama": 58, "gpt2": 44}

# what a llama block issued beyond today's counts while its dense SwiGLU kept silu(w1 x) for backward, before
# models/swiglu_kernel.py silu_mul (Training.silu_kept, the runs recorded so): its backward one op fewer (silu's
# backward read the kept output; silu_mul's runs silu again), a selective-ops replay's backward and a full
# replay's detaches two more each (the kept output cached and restored). Counted as OPS_SELECTIVE_REPLAY was.
SILU_KEPT_OPS = {"backward": -1, "selective_backward": 2, "replay_detaches": 2}

# what each projection's own cast of its input added to a block under autocast, (forward, backward), before
# the attention and the MLP cast it once (Training.linear_casts: how the runs recorded before ran); a
# selective-ops replay reruns the forward's
LINEAR_CAST_OPS = {"llama": (3, 3), "gpt2": (2, 2)}

# HBM bytes of an RMSNorm of fp32 input, (per element, per row): a fused kernel (CUDA's
# aten._fused_rms_norm) reads x and writes y and the row's rstd; the CPU decomposition (pow, mean, add_,
# rsqrt, mul, mul) reads and writes the row four times over (pow 8, mean 4, two muls 8 each) and its
# per-row scalar five times (mean's output 4, add_ 8, rsqrt 8, the mul's read 4).
RMS_NORM_BYTES = {"fused": (8, 4), "decomposed": (28, 24)}


def silu_kept_ops(shape: ModelShape, silu_kept: bool, key: str) -> int:
    """SILU_KEPT_OPS[key] for a llama block of a run recorded while its SwiGLU kept silu's output, else 0."""
    return SILU_KEPT_OPS[key] if silu_kept and shape.cfg.arch == "llama" else 0


def alternate_replayed(shape: ModelShape) -> int:
    """Weights a dense block's replayed products multiply under selective-ops-alternate: of its linear layers in
    the order it runs them (block_linears; memory/recompute.py), the 2nd, 4th, ...: llama's wk, wo and w3,
    GPT-2's wk and wo, and its w2 where dropout follows it (else the replay stops before the block's last product,
    whose output no backward reads)."""
    products = block_linears(shape)
    replayed = products[1::2]
    if len(products) % 2 == 0 and not shape.cfg.dropout:  # the last product is among them, nothing after it kept
        replayed = replayed[:-1]
    return sum(i * o for i, o in replayed)


def replay_detaches(shape: ModelShape, lay: Layout, compiled: bool, silu_kept: bool = False) -> float:
    """The detaches recomputed blocks add to one rank's eager step (FULL_REPLAY_DETACHES per block and
    micro-batch; `silu_kept`: Training.silu_kept); compiled, the rerun is the graph's, which issues none."""
    if lay.recompute not in REPLAYING or compiled or shape.is_bare:
        return 0.0
    per_block = FULL_REPLAY_DETACHES[shape.cfg.arch] + silu_kept_ops(shape, silu_kept, "replay_detaches")
    return rank_layers(shape, lay) * per_block * lay.num_microbatches


def replay_ops(shape: ModelShape, lay: Layout, mode: str, compiled: bool, linear_casts: bool = False,
               silu_kept: bool = False) -> float:
    """The ops a per-op policy adds to one rank's eager step (OPS_SELECTIVE_REPLAY, OPS_ALTERNATE_REPLAY per
    block and micro-batch, `mode` the OPS_PER_BLOCK column; `linear_casts`: the projections' own input casts
    replayed, LINEAR_CAST_OPS's forward count; `silu_kept`: Training.silu_kept). MoE layers are charged as
    the dense blocks. `compiled`: none (module docstring)."""
    if lay.recompute not in SELECTIVE_OPS or shape.is_bare or compiled:
        return 0.0
    counted = OPS_ALTERNATE_REPLAY if lay.recompute == "selective-ops-alternate" else OPS_SELECTIVE_REPLAY
    extra = LINEAR_CAST_OPS[shape.cfg.arch][0] if linear_casts and mode == "autocast" else 0
    extra += silu_kept_ops(shape, silu_kept, "selective_backward")
    return rank_layers(shape, lay) * (sum(counted[(shape.cfg.arch, mode)]) + extra) * lay.num_microbatches


def _cast(elems: float, src: int, dst: int) -> float:
    """A dtype conversion reads `elems` at `src` bytes and writes them at `dst` (none if they match)."""
    return elems * (src + dst) if src != dst else 0.0


def _rms(rows: float, dim: int, x: int, param: int, norm: str, upcast: bool = False) -> float:
    """models/layers.py RMSNorm of `rows` rows of `dim` at `x` bytes. x in the weight's dtype: the kernel
    takes both as they are (the fused kernel reads x and writes y at x's width; the CPU's composite
    upcasts x and casts back inside). Else, or `upcast` (Widths.norms_fp32): upcast to fp32, the norm, the
    weight's fp32 copy, the cast back."""
    per_elem, per_row = RMS_NORM_BYTES[norm]
    elems = rows * dim
    if x == param and not upcast:
        inner = elems * per_elem * x / 4 if norm == "fused" else 2 * _cast(elems, x, 4) + elems * per_elem
        return inner + rows * per_row + dim * x
    return (2 * _cast(elems, x, 4) + _cast(dim, param, 4) + elems * per_elem + rows * per_row + dim * 4)


def _rope(rows: float, width: int, positions: int, head: int, c: int, table: int) -> float:
    """apply_rotary on `rows` tokens of `width` at `c` bytes: neg of one half (1 + 1 half), the cat
    (2), x*cos and rotated*sin (2 + 2, each reading its (T, hs) table), their sum (3); the tables cast
    to the compute width first when they are wider."""
    elems = rows * width
    return 10 * elems * c + 2 * positions * head * c + 2 * _cast(positions * head, table, c)


def _weight_casts(shape: ModelShape, w: Widths, tp: int) -> float:
    """Autocast copies of a block's linear weights and biases (fp32 read, compute width written), remade
    in the replay: the forward's copies are not kept (planner/activations.py)."""
    if not w.autocast_copies:
        return 0.0
    elems = sum(math.prod(s) for name, s in shape.param_shapes()
                if name.startswith("layers.0.") and "norm" not in name)
    return elems / tp * (w.param + w.compute)


def replay_bytes(shape: ModelShape, w: Widths, micro_batch: int, seq: int, tp: int = 1, sp: bool = False,
                 norm: str = "fused") -> float:
    """HBM bytes the ops selective-ops replays read and write, one block, one micro-batch of
    `micro_batch` x `seq` tokens on one rank, each op from the block's shapes (models/layers.py): the
    residual stream at `w.param` bytes (fp32 parameters keep it fp32 under autocast), the projections
    at `w.compute`. Tensor parallelism splits the heads and the MLP; the norms and the residual add
    split only under sequence parallelism. `norm`: how an RMSNorm runs (RMS_NORM_BYTES)."""
    c = shape.cfg
    r, cw = w.param, w.compute
    tokens = micro_batch * seq
    res = tokens / (tp if sp else 1)  # tokens of the residual stream on this rank
    # key/value heads fewer than tp are replicated, one whole head a rank (parallel/tp_plan.py colwise_kv)
    q, kv, f = c.n_heads * c.head_width / tp, max(1, c.kv_heads // tp) * c.head_width, c.ffn_dim / tp
    d = c.d_model
    add = res * d * (r + cw + max(r, cw))  # h + attn: the stream and the attention's output, the sum
    # autocast casts the attention's and the MLP's input once each (before: each first-layer linear's)
    linears_in = 3 + (2 if c.arch == "llama" else 1) if w.linear_casts else 2
    moved = add + _weight_casts(shape, w, tp) + (linears_in * _cast(res * d, r, cw) if w.autocast_copies else 0)
    if c.arch == "llama":
        moved += 2 * _rms(res, d, r, r, norm, w.norms_fp32)
        moved += sum(_rope(tokens, width, seq, c.head_width, cw, r) for width in (q, kv))
        moved += 5 * tokens * f * cw  # silu (1 + 1), its product with w3's output (2 + 1)
        for width in (q, kv) if c.qk_norm != "none" else ():
            heads = width / c.head_width if c.qk_norm == "head" else 1  # "head": one norm per head
            moved += _rms(tokens * heads, width / heads, cw, r, norm, w.norms_fp32)
    else:
        # read x, write y; weight and bias; a row's mean and rstd (at x's width on CPU, fp32 on CUDA: the
        # difference, 4 bytes a row in low precision, is left out)
        ln = res * d * 2 * r + (2 if c.use_bias else 1) * d * r + res * 2 * r
        moved += 2 * ln + 2 * tokens * f * cw  # gelu (1 + 1)
    return moved


def replay_s(shape: ModelShape, w: Widths, lay: Layout, seq: int, hbm_bytes_per_s: float, compiled: bool) -> float:
    """Seconds of one rank's step that a per-op policy's replayed ops stream through HBM (replay_bytes for
    each block of the stage and each micro-batch; selective-ops-alternate's replayed GEMMs are FLOPs,
    time.recompute_flops). `compiled`: none, fused into the backward's kernels (module docstring)."""
    if lay.recompute not in SELECTIVE_OPS or shape.is_bare or compiled:
        return 0.0
    per = replay_bytes(shape, w, lay.micro_batch, seq // lay.cp, lay.tp, lay.sequence_parallel)
    return rank_layers(shape, lay) * lay.num_microbatches * per / hbm_bytes_per_s
