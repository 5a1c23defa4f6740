"""What this version runs: every check of a config's layout, as rules on the config alone (no model,
no process group, nothing communicates). `parallelize()`, and `teratrain train` before any process
starts, call `check_supported`; parallel.auto tries each candidate layout through it; the planner
refuses the same layouts through the same rules (`zero_problem`, `grad_dtype_problem`, and
config_schema.compile_scope_problem). Each strategy's own shape checks live in its plan
(tp_plan.check_tp, ep_plan.check_ep, cp_plan.check_cp, pipeline/split.check_split); this module calls them in order.
"""

from __future__ import annotations

from teratrain.config_base import ConfigError
from teratrain.parallel.cp_plan import check_cp
from teratrain.parallel.ep_plan import check_ep
from teratrain.parallel.pipeline.schedules import ASYNC_SCHEDULES
from teratrain.parallel.pipeline.split import check_split
from teratrain.parallel.tp_plan import check_tp


def check_supported(cfg) -> None:
    """Refuse loudly, with the fix, what this version cannot do (never a silent fallback)."""
    p = cfg.parallel
    check_tp(cfg)
    if cfg.memory.loss_chunks > 1 and p.tp > 1:
        raise ConfigError(f"memory.loss_chunks={cfg.memory.loss_chunks} chunks one device's whole output head, and "
                          f"parallel.tp={p.tp} splits the head and its loss over the vocabulary instead; set "
                          "memory.loss_chunks=0 (auto) or 1.")
    check_pipeline(cfg)
    check_ep(cfg)
    check_cp(cfg)
    why = (zero_problem(p.zero, p.offload) or grad_dtype_problem(p.grad_dtype, p.zero, low_params(cfg))
           or cfg.compile_scope_problem())
    if why:
        raise ConfigError(why)
    if cfg.train.cuda_graphs and p.pp > 1:
        raise ConfigError("train.compile_mode=reduce-overhead keeps one static pool of saved activations per CUDA "
                          "graph, and a pipeline keeps several micro-batches in flight; set parallel.pp=1 or "
                          "train.compile_mode=default.")
    if cfg.train.cuda_graphs and cfg.model.moe.enabled and cfg.memory.precision != "bf16":
        raise ConfigError(f"train.compile_mode=reduce-overhead with model.moe needs memory.precision=bf16: in "
                          f"{cfg.memory.precision} the experts' grouped GEMM reads its row offsets back to the host, "
                          "which a CUDA graph cannot hold; set memory.precision=bf16 or train.compile_mode=default.")
    if cfg.train.cuda_graphs and p.sync != "allreduce":
        raise ConfigError(f"train.compile_mode=reduce-overhead needs engines that keep their own gradient buffers, "
                          f"and parallel.sync={p.sync} adopts the graphs' gradients; set parallel.sync=allreduce or "
                          "train.compile_mode=default.")
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


def zero_problem(zero: int, offload: str) -> str | None:
    """Why the ZeRO engine cannot run this combination (one sentence with the fix), or None. The
    planner refuses the same layouts through this function."""
    if offload == "params" and zero != 3:
        return (f"parallel.offload=params needs parameter sharding (parallel.zero=3, got {zero}); "
                "set parallel.zero=3 or parallel.offload=optimizer.")
    if offload != "none" and zero == 0:
        return "parallel.offload needs a ZeRO engine to own the sharded optimizer; set parallel.zero>=1."
    return None


def low_params(cfg) -> bool:
    """Are the model's trainable parameters (and so their gradients) in bf16/fp16?"""
    return cfg.memory.precision != "fp32" and cfg.use_master_weights


def grad_dtype_problem(grad_dtype: str, zero: int, low: bool) -> str | None:
    """Why parallel.grad_dtype cannot apply (one sentence with the fix), or None; `low`: the
    parameters are bf16/fp16 (low_params). The planner refuses the same layouts."""
    if grad_dtype == "fp32":
        return None
    if zero == 0:
        return (f"parallel.grad_dtype={grad_dtype} sets the ZeRO engines' gradient buffer, and with parallel.zero=0 "
                "gradients take the parameters' dtype; set parallel.zero>=1 or parallel.grad_dtype=fp32.")
    if not low:
        return (f"parallel.grad_dtype={grad_dtype} stores the gradients of bf16/fp16 parameters, and this run's are "
                "fp32 (memory.precision=fp32 or memory.master_weights=false); set memory.precision=bf16 or "
                "parallel.grad_dtype=fp32.")
    return None


def check_pipeline(cfg) -> None:
    """What pipelining composes with (docs/pipeline.md, "What composes with a pipeline", says the same)."""
    p = cfg.parallel
    check_split(cfg)
    if p.pp == 1:
        return
    if p.zero == 3 and p.schedule in ASYNC_SCHEDULES:
        raise ConfigError(f"parallel.schedule={p.schedule} updates the weights in the middle of a step and keeps "
                          "whole stashed copies of them, which parallel.zero=3 keeps sharded between steps; use a "
                          "flush schedule (e.g. parallel.schedule=1f1b) or parallel.zero<=2.")
    if p.sync != "allreduce":
        raise ConfigError(f"parallel.sync={p.sync} keeps whole replicas on every rank; set parallel.pp=1 or "
                          "parallel.sync=allreduce.")
    if cfg.model.moe.enabled and cfg.model.moe.aux_loss_convention == "transformers":
        raise ConfigError("model.moe.aux_loss_convention=transformers pools every MoE layer's tokens into one loss, "
                          "which pipeline stages holding different layers cannot form; use aux_loss_convention=ours "
                          "with parallel.pp>1 (docs/moe.md, \"Auxiliary loss: two conventions\").")
    if cfg.memory.compress_activations != "none" and p.schedule == "zb-h1":
        raise ConfigError("parallel.schedule=zb-h1 records what each forward saves to split its backward, which "
                          "memory.compress_activations would encode out of its sight; use another schedule "
                          "(e.g. 1f1b) or memory.compress_activations=none.")
