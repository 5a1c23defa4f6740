"""The one place that decides the order in which strategies are applied to a model.

Order, each with its reason:
0. placements       - every parameter gets the plain placement (whole, averaged over dp); the
                      transforms below overwrite what they split, so nothing downstream guesses.
1. pipeline split   - decides which blocks this rank holds; everything after works on the local part.
2. tensor/sequence  - swaps linear layers for sharded ones before anything wraps or hooks them.
3. expert parallel  - shards experts after TP so expert layers see their final shapes.
4. recompute        - wraps the (now local, sharded) blocks; must see the final modules to replay them.
5. compile          - traces the final module structure, checkpoints included.
6. data parallel / ZeRO / local SGD / parameter server - outermost: hooks gradients of the final
   parameters and owns the update; it also materializes the meta-device model, so ZeRO-3 never holds
   more than one full block (and a parameter server only the parameters it owns).
"""

from __future__ import annotations

from torch import nn

from teratrain.config import ConfigError
from teratrain.memory.recompute import apply_recompute
from teratrain.models.transformer import init_param_
from teratrain.optim.engine import LocalEngine
from teratrain.parallel.expert import apply_ep, check_ep
from teratrain.parallel.placement import assign_defaults, materialize
from teratrain.parallel.tensor import apply_tp, check_tp


def parallelize(model: nn.Module, rt, cfg):
    """Apply every configured strategy to `model` (on the meta device); return the update engine."""
    check_supported(cfg)  # cheap and pure: train.run also calls it first, to fail before any setup
    assign_defaults(model)  # 0
    if rt.dims.tp > 1:  # 2
        apply_tp(model, rt, cfg)
    if cfg.model.moe.enabled:  # 3: records expert placements at any ep; ep > 1 also drops the others' experts
        apply_ep(model, rt, cfg)
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every)  # 4
    if cfg.train.compile:  # 5: in place, so parameter names keep no `_orig_mod.` prefix
        model.compile()
    return build_engine(model, rt, cfg)  # 6


def check_supported(cfg) -> None:
    """Refuse loudly, with the fix, what this version cannot do (never a silent fallback)."""
    p = cfg.parallel
    if p.pp > 1:
        raise ConfigError(f"parallel.pp={p.pp}: pipeline parallelism is not available in this version; "
                          "set parallel.pp=1.")
    check_tp(cfg)
    check_ep(cfg)
    if p.zero >= 1 and cfg.optim.name == "adafactor":
        raise ConfigError("optim.name=adafactor factors whole matrices, which ZeRO splits into flat shards; "
                          "use optim.name=adamw or sgd with parallel.zero>=1.")
    if p.offload == "params" and p.zero != 3:
        raise ConfigError(f"parallel.offload=params needs parameter sharding (parallel.zero=3, got {p.zero}); "
                          "set parallel.zero=3 or parallel.offload=optimizer.")
    if p.offload != "none" and p.zero == 0:
        raise ConfigError("parallel.offload needs a ZeRO engine to own the sharded optimizer; set parallel.zero>=1.")
    if p.zero == 3 and cfg.train.compile:
        raise ConfigError("train.compile does not trace ZeRO-3's gather/free hooks; set train.compile=false "
                          "or parallel.zero<=2.")
    if p.sync != "allreduce" and p.zero:
        raise ConfigError(f"parallel.sync={p.sync} keeps whole replicas and cannot shard them; "
                          "set parallel.zero=0 or parallel.sync=allreduce.")
    if p.sync != "allreduce" and p.tp > 1:
        raise ConfigError(f"parallel.sync={p.sync} keeps whole replicas on every rank; set parallel.tp=1 "
                          "or parallel.sync=allreduce.")
    for key, mode, unset in (("sync_every", "local-sgd", 1), ("staleness", "param-server", None),
                             ("num_servers", "param-server", 1)):
        if getattr(p, key) != unset and p.sync != mode:
            raise ConfigError(f"parallel.{key}={getattr(p, key)} only applies to parallel.sync={mode} (this run has "
                              f"{p.sync}); set parallel.sync={mode} or leave parallel.{key} at its default.")


def init_fn(cfg):
    """How a whole parameter is initialized: by its global name and the seed only."""
    return lambda t, name: init_param_(t, name, cfg.model, cfg.train.seed)


def build_engine(model: nn.Module, rt, cfg):
    p = cfg.parallel
    if p.sync == "param-server":  # before the one-process case: one worker still talks to its servers
        from teratrain.parallel import param_server

        return param_server.build(model, rt, cfg)
    if p.zero >= 1:
        from teratrain.parallel.zero import ZeroEngine

        return ZeroEngine(model, cfg, rt, init_fn(cfg))
    materialize(model, rt.device, init_fn(cfg))
    if rt.dims.workers == 1:  # one process: local SGD and all-reduce both reduce to the plain update
        return LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
    if p.sync == "local-sgd":
        from teratrain.parallel.sync import LocalSGDEngine

        return LocalSGDEngine(model, cfg, rt)
    from teratrain.parallel.data import DataParallelEngine

    return DataParallelEngine(model, cfg, rt)
