"""Differences between the torch versions we support (2.11 on the GPU machines, 2.13 on CPU ones).
Every version check lives here; the rest of the code imports names from this module."""

from __future__ import annotations

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


def host_empty_cache() -> None:
    """Give the pinned host blocks the caching host allocator keeps back to the OS (a private call
    in both versions; absent from a build without it, where nothing is cached to give back)."""
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None and torch.cuda.is_available():
        release()
