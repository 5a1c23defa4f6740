"""Differences between the torch versions we support (2.11 on the GPU machines, 2.13 on CPU ones).
Every version check lives here; the rest of the code imports names from this module."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

# 2.13 renamed the flat collectives (`*_tensor` / `*_into_tensor` still work there but warn).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def pinned_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory when a CUDA device exists (fast async copies), plain otherwise:
    a CPU-only build cannot pin."""
    return torch.empty(n, dtype=dtype, pin_memory=torch.cuda.is_available())


def in_backward() -> bool:
    """True while autograd's engine is running a backward pass (e.g. during recomputation)."""
    return torch._C._current_graph_task_id() != -1


# fp8 e4m3 (OCP FP8, Micikevicius et al. 2022): present in every torch we support; None if a build lacks it.
FLOAT8_E4M3 = getattr(torch, "float8_e4m3fn", None)


def reparametrize(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: run `module` with `tensors` (by parameter name) in place of its parameters.
    torch.func.functional_call's own context manager, which is private (same in 2.11 and 2.13)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors)


# Grouped GEMM (torch >= 2.8, the same private name in 2.11 and 2.13; 2.13 also has the public
# F.grouped_mm, a thin wrapper of it): (M, K) rows x (G, K, N) weights, offs (G,) int32 cumulative
# row counts; rows past offs[-1] are left uncomputed (their output memory is uninitialized).
grouped_mm = getattr(torch, "_grouped_mm", None)
GROUPED_MM_ROW_ALIGN = 8  # rows per group padded to 16 bytes of bf16, as torchtitan does for this kernel


def grouped_mm_without_sync(device: torch.device, dtype: torch.dtype) -> bool:
    """True where torch._grouped_mm runs its CUTLASS kernel, which reads the offsets on the device:
    bf16 on sm90 (Hopper) and sm100 (aten/src/ATen/native/cuda/GroupedBlas.cpp, `use_fast_path`).
    Elsewhere (other GPUs, fp32, CPU) it falls back to a loop of matmuls that copies the offsets to
    the host, so the caller's own loop is as good there."""
    if grouped_mm is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def host_empty_cache() -> None:
    """Give the pinned host blocks the caching host allocator keeps back to the OS (a private call
    in both versions; absent from a build without it, where nothing is cached to give back)."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None and torch.cuda.is_available():
        release()


def backward_from(edges: list, grads: list) -> None:
    """torch.autograd.backward(edges, grads) without its Python check of every root's gradient (a
    shape comparison through symbolic-shape helpers, ~10 us a root; ZB-H1's W has a root per weight,
    each gradient already shaped and typed as its edge takes it). The engine's entry point is
    private, with the same arguments in 2.11 and 2.13."""
    torch.autograd.graph._engine_run_backward(tuple(edges), tuple(grads), False, False, (), allow_unreachable=True,
                                              accumulate_grad=True)


def release_compiled() -> None:
    """Drop torch.compile's compiled code and its CUDA graph trees (private, the same in 2.11 and
    2.13). Graphs that captured NCCL collectives keep the communicators in use: destroying the process
    group behind them, or exiting, hangs (pytorch#115388), so a graphed run releases them first."""
    import gc

    torch._dynamo.reset()
    if torch.cuda.is_available():
        from torch._inductor import cudagraph_trees

        torch.cuda.synchronize()
        cudagraph_trees.reset_cudagraph_trees()
    gc.collect()


# inductor's passes that move collectives against compute, in the order torch's config recommends
# (torch/_inductor/config.py); a build that lacks one runs the others
OVERLAP_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                  "reorder_communication_preserving_peak_memory")


def compile_comm_overlap(enabled: bool) -> list[str]:
    """Set inductor's compute/communication reordering for what this process compiles next (a
    process-wide setting: each parallelize() call states it); returns the passes it runs."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor

    passes = [p for p in OVERLAP_PASSES if enabled and hasattr(comms, p)]
    inductor.reorder_for_compute_comm_overlap = bool(passes)
    inductor.reorder_for_compute_comm_overlap_passes = passes
    return passes


def compile_async_tp(group, workspace_bytes: int = 0) -> bool:
    """Inductor's micro-pipeline pass (PyTorch's async TP) for what this process compiles next, over
    `group`'s symmetric memory, or off with None (a process-wide setting: each parallelize() call states
    it). The pass replaces an all-gather and the GEMMs that read it (a GEMM and the reduce-scatter after
    it) with one fused op that moves the pieces with copy engines while the GEMM runs on the pieces
    already there. The fused ops' workspace (`workspace_bytes`, a collective allocation) is made here:
    first made while CUDA graph trees warm up, it would stay in their pool untracked, which they refuse
    at the next recording. Returns whether it is on."""
    import torch._inductor.config as inductor

    from teratrain.config_base import ConfigError

    current = inductor.post_grad_custom_pre_pass
    mine = getattr(current, "uuid", lambda: None)() == FOLD_RESHAPES
    if group is not None and current is not None and not mine:
        raise ConfigError("parallel.tp_overlap=async needs inductor's post_grad_custom_pre_pass (to fold the reshapes "
                          "between its gathers and GEMMs) and this process has set one; unset "
                          "torch._inductor.config.post_grad_custom_pre_pass or set parallel.tp_overlap=none.")
    inductor._micro_pipeline_tp = group is not None
    if group is None:
        if mine:
            inductor.post_grad_custom_pre_pass = None
        return False
    inductor.post_grad_custom_pre_pass = current if mine else _fold_reshapes_pass()
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_symm_mem_enabled_for_group(group.group_name):  # on by default (and the call
        symm.enable_symm_mem_for_group(group.group_name)  # deprecated) on torch 2.11
    if workspace_bytes:
        symm.get_symm_mem_workspace(group.group_name, min_size=workspace_bytes)
    return True


def _fold_reshapes(graph) -> None:
    """reshape(reshape(x)) -> reshape(x) in a post-grad graph. A sequence gather's rows (rows, d) are
    viewed (B, T, d) for the block and back to (rows, d) by each linear; the async-TP pass looks for
    GEMMs among the gathered tensor's own users, so the pair must go (the values are the same: a
    reshape keeps the elements' order)."""
    shape_ops = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)

    def shape(node):  # static sizes only: comparing symbolic ones would add guards
        size = getattr(node.meta.get("val"), "shape", None) if isinstance(node, torch.fx.Node) else None
        return tuple(size) if size is not None and all(isinstance(d, int) for d in size) else None

    inners, erased = {}, set()
    for node in list(graph.nodes):
        inner = node.args[0] if node.op == "call_function" and node.target in shape_ops else None
        if isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target in shape_ops:
            node.target, node.args = torch.ops.aten.reshape.default, (inner.args[0], *node.args[1:])
            inners[inner] = None
            if shape(node) is not None and shape(node) == shape(node.args[0]):  # back where it started
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                erased.add(node)
    for inner in reversed(inners):  # only what this pass left without users (inductor runs no DCE here)
        if inner not in erased and not inner.users:
            graph.erase_node(inner)
            erased.add(inner)


FOLD_RESHAPES = "teratrain.compat.fold_reshapes.1"  # the FX graph cache keys compiled graphs on a pass's uuid


def _fold_reshapes_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FoldReshapes(CustomGraphPass):
        def __call__(self, graph) -> None:
            _fold_reshapes(graph)

        def uuid(self) -> str:
            return FOLD_RESHAPES

    return FoldReshapes()


def compile_checkpoint_side_effects() -> None:
    """Let torch.compile trace a checkpointed block that writes module attributes (an MoE layer's aux
    loss and statistics) without replaying those writes when the backward recomputes the block, as
    eager recomputation skips them (MoE._record) and as torchtitan sets for its MoE. A dynamo setting
    of the process (present in 2.13, checked here; a build without it keeps the graph break at the
    checkpoint, which then runs eager)."""
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def nccl_options(max_ctas: int | None, min_ctas: int | None = None):
    """ProcessGroupNCCL options that cap the thread blocks (CTAs, one SM each) NCCL runs a collective
    on (ncclConfig_t.maxCTAs, NCCL >= 2.17; `min_ctas` its floor, minCTAs) for a group made under the
    job's NCCL process group, or None: no cap asked for, no NCCL in this build (CPU wheels), or a job on
    another backend (gloo takes no NCCL options). The same binding in 2.11 and 2.13."""
    if max_ctas is None or not hasattr(dist, "ProcessGroupNCCL") or not dist.is_initialized() \
            or dist.get_backend() != "nccl":
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = max_ctas
    if min_ctas is not None:
        opts.config.min_ctas = min_ctas
    return opts


def torchao_float8():
    """torchao.float8 (memory/fp8.py), imported without the warnings torchao's import prints where its
    compiled extensions do not load (a CPU build; none of them is used by float8 training) or where torch
    deprecated a registration it makes. Raises ImportError where torchao is not installed."""
    import importlib
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.float8")
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


# Attention that also returns its log-sum-exp, as ring attention merges partial results by it (and its
# backward takes the merged output and log-sum-exp). Private aten ops, the same in 2.11 and 2.13: on CPU
# the flash kernel (any float dtype), on CUDA flash for fp16/bf16 with head dim <= 256, else the
# memory-efficient kernel (fp32 too). `rest` is what a backward needs of its forward besides the tensors.
_aten = torch.ops.aten


def attention_lse_kind(q: torch.Tensor) -> str | None:
    """Which fused kernel `attention_lse` runs for queries like `q`: "cpu", "flash", "efficient", or
    None when this build has none of them (the caller then uses its own math)."""
    if q.device.type == "cpu":
        return "cpu" if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") else None
    if q.device.type != "cuda":
        return None
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return "flash"
    return "efficient"


def attention_lse(q, k, v, causal: bool, scale: float, kind: str):
    """(out (B, H, T, D), lse (B, H, T) fp32, rest) of softmax(q k^T * scale [causal, top-left]) v; q, k, v
    with equal head counts."""
    if kind == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kind == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]], (seed, offset)  # (older builds pad the rows to a multiple of 32)


def attention_lse_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kind: str, rest):
    """(dq, dk, dv) of `attention_lse`'s output, given the output and log-sum-exp its rows end with (those
    of the whole attention when the call covered only some of the keys: each call's share of the
    gradient then adds up to the whole)."""
    if kind == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                          scale=scale)
    if kind == "flash":
        cum_q, cum_k, seed, offset = rest
        return _aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2],
                                                                 k.shape[2], 0.0, causal, seed, offset, scale=scale)
    seed, offset = rest
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def float8_linear(recipe: str, emulate: bool):
    """torchao's float8 training GEMM for one recipe (memory/fp8.py): (its autograd function
    `matmul_with_hp_or_float8_args`, the recipe's Float8LinearConfig, the LinearMMConfig of its three
    GEMMs), built as torchao's own Float8Linear builds them. The function and the positional
    ScaledMMConfig are torchao internals (the same in 0.17 and 0.18): they are reached here only."""
    import dataclasses
    import importlib

    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)

    def mm(gemm):  # (emulate, use_fast_accum, fp8_output, pad_inner_dim)
        return ao.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)

    matmul = importlib.import_module("torchao.float8.float8_linear").matmul_with_hp_or_float8_args
    return matmul, config, ao.LinearMMConfig(mm(config.gemm_config_output), mm(config.gemm_config_grad_input),
                                             mm(config.gemm_config_grad_weight))


def float8_weight_cast():
    """torchao's pieces of a tensorwise float8 weight cast, for ZeRO-3's float8 gathers
    (parallel/zero_fp8.py): (amax_to_scale, to_fp8_saturated, Float8TrainingTensor, the WEIGHT role).
    The first two are the very functions torchao's dynamic cast calls, so a shard cast with them gives
    the bytes torchao's own cast of the whole weight gives; internals, the same in 0.17 and 0.18."""
    import importlib

    ao = torchao_float8()
    utils = importlib.import_module("torchao.float8.float8_utils")
    return utils.amax_to_scale, utils.to_fp8_saturated, ao.Float8TrainingTensor, ao.GemmInputRole.WEIGHT


@functools.cache
def _aten_ops(names: tuple[str, ...]) -> frozenset:
    """The default overloads of the aten ops `names` this torch has, looked up once (each checkpointed block's
    per-op policy asks). By name: an op this torch lacks (the grouped GEMM, one SDPA backend on CPU builds) is
    left out, so 2.11 and 2.13 both work."""
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def gemm_ops() -> frozenset:
    """The matrix products (plain, batched, float8, grouped) whose outputs the per-op recomputation policies
    keep (memory/recompute.py)."""
    return linear_gemm_ops() | _aten_ops(("bmm", "baddbmm", "_grouped_mm", "_scaled_grouped_mm"))


def linear_gemm_ops() -> frozenset:
    """The products a linear layer dispatches (with or without bias, float8), which
    memory.recompute=selective-ops-alternate alternates over (memory/recompute.py)."""
    return _aten_ops(("mm", "addmm", "_scaled_mm"))


def attention_ops() -> frozenset:
    """The fused attention kernels whose outputs (the logsumexp among them) the per-op recomputation policies
    keep (memory/recompute.py)."""
    return _aten_ops(("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"))
