"""The one place that decides the order in which strategies are applied to a model.

Order, each with its reason:
1. pipeline split   - decides which blocks this rank holds; everything after works on the local part.
2. tensor/sequence  - swaps linear layers for sharded ones before anything wraps or hooks them.
3. expert parallel  - shards experts after TP so expert layers see their final shapes.
4. recompute        - wraps the (now local, sharded) blocks; must see the final modules to replay them.
5. compile          - traces the final module structure, checkpoints included.
6. data parallel / ZeRO - outermost: hooks gradients of the final parameters and owns the update.
"""

from __future__ import annotations

from torch import nn

from teratrain.config import ConfigError
from teratrain.memory.recompute import apply_recompute
from teratrain.optim.engine import LocalEngine


def parallelize(model: nn.Module, rt, cfg):
    """Apply every configured strategy to `model` (materialized, fp32); return the update engine."""
    p = cfg.parallel
    for key, what in (("pp", "pipeline"), ("tp", "tensor"), ("ep", "expert")):
        if getattr(p, key) > 1:  # 1-3: these strategies land in later releases; refuse loudly, never silently
            raise ConfigError(f"parallel.{key}={getattr(p, key)}: {what} parallelism is not available in this "
                              f"version; set parallel.{key}=1.")
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every)  # 4
    if cfg.train.compile:  # 5: in place, so parameter names keep no `_orig_mod.` prefix
        model.compile()
    return build_engine(model, rt, cfg)  # 6


def build_engine(model: nn.Module, rt, cfg):
    p = cfg.parallel
    if rt.dims.dp == 1 and p.zero == 0 and p.offload == "none":
        return LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
    raise ConfigError(f"data parallelism / ZeRO / offload (dp={rt.dims.dp}, zero={p.zero}, offload={p.offload}) "
                      "is not available in this version; run one process with parallel.zero=0 and offload=none.")
