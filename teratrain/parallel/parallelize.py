"""The one place that decides the order in which strategies are applied to a model.

Order, each with its reason:
0. LoRA, placements - adapters are added to the single-device model (memory/lora.py), so every
                      later transform sees them; then every parameter gets the plain placement
                      (whole, averaged over dp), which the transforms below overwrite where they split.
1. pipeline split   - decides which blocks this rank holds; everything after works on the local part.
2. tensor/sequence  - swaps linear layers for sharded ones before anything wraps or hooks them.
   stage placements - after tp, which re-creates the placements of what it splits: every parameter
                      records its pipeline stage; a tied embedding held at both ends gets its group.
2b. context parallel - swaps the sequence layout and each attention core (parameter-free modules), on
                      the final blocks, before recompute wraps the cores (parallel/context.py).
3. expert parallel  - shards experts after TP so expert layers see their final shapes.
3b. fp8             - the block linears' GEMMs in float8 (memory/fp8.py), on the final (tp-split) layers,
                      before recompute and compile wrap and trace them.
4. recompute        - wraps the (now local, sharded) blocks; must see the final modules to replay them;
                      activation compression then hooks what the final blocks save for backward.
5. compile          - traces the final module structure, checkpoints included (under a pipeline each
                      block: a stage never runs the model's whole forward).
6. data parallel / ZeRO / local SGD / parameter server - outermost: hooks gradients of the final
   parameters and owns the update; it also materializes the meta-device model, so ZeRO-3 never holds
   more than one full block (and a parameter server only the parameters it owns).
7. connect           - last, once every group is known: each group's communicator is set up in one
                      order on every rank, never lazily mid-step (mesh.Mesh.connect).
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain import compat
from teratrain.config_base import ConfigError
from teratrain.config_schema import resolved_compile_scope
from teratrain.memory import step_casts
from teratrain.memory.compression import apply_compression
from teratrain.memory.fp8 import apply_fp8
from teratrain.memory.lora import LoraInit, apply_lora
from teratrain.memory.recompute import apply_recompute
from teratrain.models.moe import moe_layers
from teratrain.models.protocol import blocks, is_builtin
from teratrain.models.transformer import init_param_
from teratrain.optim.engine import LocalEngine
from teratrain.parallel.context import apply_cp
from teratrain.parallel.expert import apply_ep
from teratrain.parallel.own_model import check_model, initial_values, retie, untie
from teratrain.parallel.pipeline.split import apply_pipeline, ends_group, mark_stages
from teratrain.parallel.placement import assign_defaults, materialize
from teratrain.parallel.support import check_supported
from teratrain.parallel.tensor import apply_tp


def parallelize(model: nn.Module, rt, cfg):
    """Apply every configured strategy to `model` and return the update engine. `model` is teratrain's
    decoder or one of your own (models/protocol.py), on the meta device or, keeping its values, a real one."""
    check_supported(cfg)  # cheap and pure: train.run also calls it first, to fail before any setup
    check_model(model, cfg)
    async_tp = async_tp_group(rt, cfg)  # before anything changes: it may refuse the device
    check_graphed_experts(rt, cfg)
    aliases = untie(model)  # shared parameters: one registration until the engine exists
    init = initial_values(model, lambda: init_fn(cfg))  # before anything moves the values
    if is_builtin(model):  # the head and loss fused and chunked over the tokens, or the plain pair
        model.chunked_loss.chunks = cfg.memory.loss_chunks
    apply_lora(model, cfg)  # 0: adapters on the single-device model, everything else frozen
    assign_defaults(model)  # 0
    layout = apply_pipeline(model, rt, cfg) if rt.dims.pp > 1 else None  # 1
    if rt.dims.tp > 1:  # 2: splits adapters with their base layers
        apply_tp(model, rt, cfg)
    if layout is not None:
        mark_stages(model, layout, ends_group(rt, layout) if cfg.model.tie_embeddings else None)
    apply_cp(model, rt, cfg)  # 2b: also sets data.document_mask's end-of-text id at cp=1
    if cfg.model.moe.enabled:  # 3: records expert placements at any ep; ep > 1 also drops the others' experts
        apply_ep(model, rt, cfg)
        if rt.dims.ep > 1:  # its all-to-all's group, asked for now so that step 7 connects it
            rt.group("ep")
    if cfg.memory.fp8 != "none":  # 3b
        apply_fp8(model, cfg, rt.device)
    apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every)  # 4
    apply_compression(model, cfg.memory.compress_activations)  # 4b: encodes what the final blocks save
    if cfg.train.compile:  # 5: in place, so parameter names keep no `_orig_mod.` prefix; a pipeline stage
        if cfg.memory.recompute != "none" and moe_layers(model):  # a recomputed MoE block writes its aux loss
            compat.compile_checkpoint_side_effects()
        # traced collectives are waited for where issued; the passes move the waits to the use, which is
        # what lets a chunked tp region's pieces overlap (parallel/tp_overlap.py)
        compat.compile_comm_overlap(cfg.train.compile_overlap or cfg.parallel.tp_overlap == "chunked")
        compat.compile_async_tp(async_tp, async_tp_workspace(cfg))
        mode = None if cfg.train.compile_mode == "default" else cfg.train.compile_mode
        for module in compile_units(model, layout is not None, cfg, rt.dims.replicas):
            if cfg.parallel.zero == 3:  # only the forward: ZeRO-3's gather and free hooks on each block run
                module.forward = torch.compile(module.forward, mode=mode)  # around it, eager (zero_gather.py)
            else:
                module.compile(mode=mode)
    engine = build_engine(model, rt, cfg, init)  # 6
    if cfg.memory.cast_once and step_casts.applies(cfg.parallel.zero, rt.dims.pp, cfg.parallel.sync):
        # train_step casts float8 weights and expert stacks once a step
        step_casts.enable(model, cfg.train.compile, graphed=cfg.train.cuda_graphs)
    for _, layer in moe_layers(model):  # on the device now: a compiled forward finds them in place
        layer.start_stats(rt.device, graphed=cfg.train.cuda_graphs)
    retie(model, aliases)
    if rt.mesh is not None:  # 7: communicators of every group asked for, now rather than at a first use
        rt.mesh.connect(rt.device)
    return engine


def async_tp_group(rt, cfg):
    """The tp group whose symmetric memory parallel.tp_overlap=async fuses over, or None."""
    if cfg.parallel.tp_overlap != "async" or rt.dims.tp == 1:
        return None
    if rt.device.type != "cuda":
        raise ConfigError(f"parallel.tp_overlap=async moves its pieces through CUDA symmetric memory and this run is "
                          f"on {rt.device.type}; set parallel.tp_overlap=none (or chunked).")
    return rt.group("tp")


def async_tp_workspace(cfg) -> int:
    """Bytes of symmetric memory async TP's fused ops ask for at most: a micro-batch's token rows of
    d_model at 4 bytes (fp32 compute; bf16 needs half). A fused reduce-scatter asks for two pieces of
    rows/tp, a gather for one, and the multicast gather (where NVLink multicast is on) for all rows.
    A larger batch than train.micro_batch under CUDA graphs would need more than was made: torch
    refuses to grow it during a capture."""
    return cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model * 4


def compile_scope(cfg, dp: int) -> str:
    """train.compile_scope resolved for this run (config_schema.resolved_compile_scope): `dp` counts the
    ranks (dp x cp) whose gradients the engine reduces from backward hooks."""
    p, t = cfg.parallel, cfg.train
    reduces = dp > 1 and p.overlap_comm and p.sync == "allreduce"
    return resolved_compile_scope(t.compile_scope, p.zero, reduces, t.cuda_graphs, cfg.memory.recompute)


def compile_units(model: nn.Module, staged: bool, cfg, dp: int) -> list[nn.Module]:
    """The modules train.compile compiles, each into graphs of its own. A pipeline stage (`staged`)
    never runs the whole forward: its blocks. Scope `model`: the whole model, one graph; its compiled
    backward runs as one autograd node and hands every gradient over at its end, so the engine's
    bucketed reductions all start after the backward. Scope `block`: each block (one graph for all
    blocks alike), and the built-in decoder's final norm and loss (the loss's fused pass over the
    logits); embeddings and the output projection run eager (one kernel each). At dp=2 on 2 x H200
    block ran 0.7% faster than model (bench/README.md, "Data parallelism against DDP")."""
    if staged:
        return list(model.layers)
    if compile_scope(cfg, dp) == "model":
        return [model]
    units = [block for _, block in blocks(model)]
    if not units and cfg.train.compile_scope == "block":
        raise ConfigError("train.compile_scope=block compiles each block apart, and this model has no blocks "
                          "(models/protocol.py: teratrain_blocks() or a `layers` list); set train.compile_scope=auto.")
    if is_builtin(model):
        units += [model.norm, model.criterion, model.chunked_loss]
    return units or [model]  # ZeRO-3 without blocks gathers the whole model around its forward


def check_graphed_experts(rt, cfg) -> None:
    """CUDA graphs hold an MoE layer only where its grouped GEMMs read no row offsets back to the host:
    torch's kernel in bf16 (check_supported refuses other precisions) on an sm90 or sm100 GPU
    (compat.grouped_mm_without_sync). Elsewhere the offsets go to the host, which a capture refuses."""
    if cfg.train.cuda_graphs and cfg.model.moe.enabled and not compat.grouped_mm_without_sync(rt.device, torch.bfloat16):
        where = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else rt.device.type
        raise ConfigError(f"train.compile_mode=reduce-overhead with model.moe needs torch's grouped GEMM kernel, which "
                          f"reads nothing back to the host, on an sm90 or sm100 GPU (H100, H200, B200), and this run "
                          f"is on {where}; set train.compile_mode=default.")


def init_fn(cfg):
    """How a whole parameter is initialized: by its global name and the seed only, or from the
    Hugging Face model of `model.init_from` (whose init reads only each rank's pieces); LoRA's
    adapters start as memory/lora.py says."""
    own = lambda t, name: init_param_(t, name, cfg.model, cfg.train.seed)  # noqa: E731
    base = own
    if cfg.model.init_from:
        from teratrain.checkpoint.hf_weights import HFInit

        base = HFInit(cfg.model.init_from, cfg.model)
    return LoraInit(base, own) if cfg.lora.rank else base


def build_engine(model: nn.Module, rt, cfg, init=None):
    """The engine of `cfg`, materializing the meta-device model with `init` (an init_fn; default: by name and seed)."""
    p, init = cfg.parallel, init or init_fn(cfg)
    if p.sync == "param-server":  # before the one-process case: one worker still talks to its servers
        from teratrain.parallel import param_server

        return param_server.build(model, rt, cfg, init)
    if p.zero >= 1:
        from teratrain.parallel.zero import ZeroEngine

        return ZeroEngine(model, cfg, rt, init)
    materialize(model, rt.device, init)
    if cfg.lora.rank and cfg.lora.base_dtype == "bf16":  # frozen weights stored in half the bytes
        for q in model.parameters():
            if not q.requires_grad:
                q.data = q.data.to(torch.bfloat16)
    if rt.dims.workers == 1:  # one process: local SGD and all-reduce both reduce to the plain update
        return LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights,
                           graphed=cfg.train.cuda_graphs)
    if p.sync == "local-sgd":
        from teratrain.parallel.sync import LocalSGDEngine

        return LocalSGDEngine(model, cfg, rt)
    from teratrain.parallel.data import DataParallelEngine

    return DataParallelEngine(model, cfg, rt)
