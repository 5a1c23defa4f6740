"""Model states per rank: parameters, gradients, optimizer state (Rajbhandari et al. 2020, "ZeRO").

ZeRO's accounting (sec. 3.1, Figure 1): mixed-precision Adam over Psi parameters keeps 2*Psi bytes
of fp16/bf16 parameters, 2*Psi of gradients and K*Psi = 12*Psi of optimizer state (fp32 master
copy + two fp32 moments): 16*Psi in all, 24 GB for the 1.5B GPT-2. Over N data-parallel ranks:
    stage 1 (P_os):       2*Psi + 2*Psi + K*Psi/N
    stage 2 (P_os+g):     2*Psi + (2 + K)*Psi/N
    stage 3 (P_os+g+p):   (2 + 2 + K)*Psi/N
Our engines differ in ways counted here, each mirrored from the code:
- LocalEngine / DataParallelEngine (zero=0): bf16 autocast keeps fp32 params and grads (4 + 4) and no
  master copy; fp16, or memory.master_weights=true, keeps 2 + 2 and a 4-byte master in the optimizer.
  Fused AdamW adds one 4-byte `step` tensor per parameter tensor.
- ZeroEngine (parallel/zero.py): flat groups (stage 1/2: buckets of ~parallel.bucket_mb; stage 3: one
  per block plus a root group) each padded to a multiple of dp, so a rank holds ceil(numel/dp) of
  every group. Reduced gradient shards are fp32 (the optimizer's dtype); stage 1 also keeps full
  low-precision gradients. Offload moves masters and moments to pinned host memory plus a host copy
  of the gradient shard; offload=params also moves stage-3 parameter shards there.
"""

from __future__ import annotations

import math
from functools import lru_cache

from teratrain.parallel.pipeline.schedules import problem
from teratrain.planner.layout import Layout, ModelShape, Training, ceil_div


class PlanError(ValueError):
    """A layout the engines refuse (mirrors parallel/parallelize.py:check_supported)."""


def zero_paper_bytes(psi: float, dp: int, stage: int, k: int = 12) -> float:
    """Per-rank model-state bytes exactly as the ZeRO paper counts them (sec. 5.1, Figure 1):
    2-byte params and grads, K bytes of optimizer state per parameter. Our engines differ where
    states.model_states says (fp32 gradient shards, stage 1's full gradients); this is the reference."""
    params, grads, opt = 2 * psi, 2 * psi, k * psi
    if stage >= 1:
        opt /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return params + grads + opt


def check_layout(shape: ModelShape, train: Training, lay: Layout) -> None:
    if lay.zero >= 1 and train.optimizer == "adafactor":
        raise PlanError("optim.name=adafactor factors whole matrices, which ZeRO splits into flat shards")
    if lay.offload == "params" and lay.zero != 3:
        raise PlanError("parallel.offload=params needs parallel.zero=3")
    if lay.offload != "none" and lay.zero == 0:
        raise PlanError("parallel.offload needs parallel.zero>=1")
    if lay.pp > 1:
        why = problem(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages)
        if why:
            raise PlanError(why.rstrip("."))
        if shape.cfg is not None and shape.cfg.n_layers < lay.pp * lay.virtual_stages:
            raise PlanError(f"{shape.cfg.n_layers} layers cannot fill {lay.pp * lay.virtual_stages} pipeline stages")


def _split_of(name: str, lay: Layout) -> int:
    """How many ways tensor/expert parallelism splits one block parameter (Megatron-LM sec. 3):
    column-parallel wq/wk/wv/w1/w3 and row-parallel wo/w2 weights by tp; row-parallel biases
    (added after the all-reduce), norms and the router replicated; experts also by ep."""
    ep = lay.ep if ".experts." in name else 1
    if "norm" in name or "router" in name or name.endswith(("wo.bias", "w2.bias")):
        return ep
    return lay.tp * ep


def stage_params(shape: ModelShape, lay: Layout) -> dict[str, int]:
    return dict(_stage_params(shape, lay.tp, lay.pp, lay.ep))


@lru_cache(maxsize=4096)
def _stage_params(shape: ModelShape, tp: int, pp: int, ep: int) -> tuple:
    """Parameters held by the first and the last pipeline stage of one rank after tensor, pipeline
    and expert sharding; the vocab-parallel embedding and head are split by tp. With tied
    embeddings and pp > 1 the last stage keeps its own copy of the embedding matrix as the head."""
    if shape.is_bare:
        p = ceil_div(shape.bare_params, tp * pp)
        return tuple({"first": p, "last": p, "block": 0, "layers": 0, "root": p, "experts": 0,
                      "expert_block": 0}.items())
    c = shape.cfg
    lay = Layout(tp=tp, pp=pp, ep=ep)
    blocks = experts = 0  # over all layers; a stage holds `layers` average blocks (MoE every k-th)
    for name, s in shape.param_shapes():
        if name.startswith("layers."):
            n = ceil_div(math.prod(s), _split_of(name, lay))
            blocks += n
            experts += n if ".experts." in name else 0
    block, expert_block = ceil_div(blocks, c.n_layers), ceil_div(experts, c.n_layers)
    layers = ceil_div(c.n_layers, pp)
    emb = ceil_div(c.vocab_size * c.d_model, tp) + (c.seq_len * c.d_model if c.arch == "gpt2" else 0)
    final_norm = c.d_model * (2 if c.arch == "gpt2" and c.use_bias else 1)
    head = ceil_div(c.vocab_size * c.d_model, tp) if (not c.tie_embeddings or pp > 1) else 0
    if pp == 1:
        root = emb + final_norm + head
        out = {"first": layers * block + root, "last": layers * block + root, "root": root}
    else:
        out = {"first": layers * block + emb, "last": layers * block + final_norm + head, "root": max(emb, final_norm + head)}
    return tuple({**out, "block": block, "layers": layers, "experts": layers * expert_block,
                  "expert_block": expert_block}.items())


def zero_groups(shape: ModelShape, train: Training, lay: Layout, local: int, experts: bool = False) -> list[list[int]]:
    """Parameter numels per ZeroEngine flat group. Exact for a whole model (tp=pp=ep=1): the
    engine's ordered_buckets() over named_parameters reversed, bucket bytes counted in the compute
    dtype. Sharded layouts use the same rule over this rank's blocks (approximation); with ep > 1,
    `local` is either the dense part of them or (`experts`) the expert part, grouped apart as the
    engine does (their reduction groups differ)."""
    w = train.widths(lay.zero, lay.offload)
    if lay.zero == 3 and not shape.is_bare:
        sp = stage_params(shape, lay)
        if lay.ep > 1:
            per = sp["expert_block"] if experts else sp["block"] - sp["expert_block"]
            return [[per]] * sp["layers"] + ([] if experts else [[local - sp["layers"] * per]])
        if lay.tp == lay.pp == 1:
            blocks: dict[int, list[int]] = {}
            root = []
            for name, s in shape.param_shapes():
                if name.startswith("layers."):
                    blocks.setdefault(int(name.split(".")[1]), []).append(math.prod(s))
                else:
                    root.append(math.prod(s))
            return list(blocks.values()) + [root]
        return [[sp["block"]]] * sp["layers"] + [[local - sp["layers"] * sp["block"]]]
    bucket_bytes = int(train.bucket_mb * 2**20)  # counted in the compute dtype (zero.py)
    if shape.is_bare or lay.tp * lay.pp * lay.ep > 1:
        per = max(1, bucket_bytes // w.param)
        return [[per]] * (local // per) + ([[local % per]] if local % per else [])
    groups, cur, size = [], [], 0
    for _, s in reversed(shape.param_shapes()):  # grads.py:ordered_buckets, one key for a whole model
        cur.append(math.prod(s))
        size += cur[-1] * w.param
        if size >= bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
    return groups + ([cur] if cur else [])


def zero_summary(shape: ModelShape, train: Training, lay: Layout, local: int) -> dict[str, int]:
    """What the memory model needs of the flat groups, computed once per distinct layout."""
    w = train.widths(lay.zero, lay.offload)
    return dict(_zero_summary(shape, lay.zero == 3, train.bucket_mb, w.param, lay.tp, lay.pp, lay.ep, lay.dp, local))


@lru_cache(maxsize=4096)
def _zero_summary(shape, zero3: bool, bucket_mb: float, pbytes: int, tp: int, pp: int, ep: int, dp: int,
                  local: int) -> tuple:
    lay = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=3 if zero3 else 1)
    train = Training(precision="bf16" if pbytes == 2 else "fp32", master_weights=pbytes == 2, bucket_mb=bucket_mb)
    experts = stage_params(shape, lay)["experts"] if ep > 1 else 0
    groups = zero_groups(shape, train, lay, local - experts)  # dense: sharded over dp
    shard, pieces = shard_of(groups, dp)
    sums = [sum(g) for g in groups] or [0]
    padded = sum(ceil_div(g, dp) * dp for g in sums)
    blocks = sums[:-1] if zero3 and len(sums) > 1 else sums
    root = sums[-1]
    if experts:  # expert groups: sharded over the dp / ep ranks holding the same experts
        egroups = zero_groups(shape, train, lay, experts, experts=True)
        e_shard, e_pieces = shard_of(egroups, dp // ep)
        esums = [sum(g) for g in egroups]
        shard, pieces = shard + e_shard, pieces + e_pieces
        padded += sum(ceil_div(g, dp // ep) * (dp // ep) for g in esums)
        if zero3:  # a block's dense and expert groups are gathered together
            blocks = [a + b for a, b in zip(blocks, esums)]
        sums = sums + esums
    return tuple({"shard": shard, "pieces": pieces, "padded": padded,
                  "groups": len(sums), "biggest": max(sums), "typical": sorted(sums)[len(sums) // 2],
                  "block": max(blocks), "blocks": len(blocks), "root": root}.items())


def shard_of(groups: list[list[int]], dp: int) -> tuple[int, int]:
    """(elements, parameter pieces) of rank 0's shard: ceil(numel/dp) per group (flat.py)."""
    elems = pieces = 0
    for numels in groups:
        s = ceil_div(sum(numels), dp)
        elems += s
        start = 0
        for n in numels:
            pieces += start < s and n > 0
            start += n
    return elems, pieces


def optimizer_elems(train: Training, shapes: list[tuple[int, ...]], numel: int, sharded: bool) -> int:
    """fp32 optimizer-state elements (master copy excluded). AdamW: m and v (Loshchilov & Hutter);
    SGD: one momentum buffer; Adafactor (Shazeer & Stern 2018): row and column second-moment sums
    per matrix, full for vectors; SM3 (Anil et al. 2019): row and column accumulators per matrix,
    full for vectors, plus momentum when used. Flat shards (ZeRO) factor as whole 1-D pieces."""
    name = train.optimizer
    if name == "adamw":
        return 2 * numel
    if name == "sgd":
        return numel if train.momentum > 0 else 0
    if sharded or not shapes:
        fact = numel  # a 1-D piece factors into itself
    else:
        fact = sum(s[0] + math.prod(s[1:]) if len(s) >= 2 else math.prod(s) for s in shapes)
    if name == "adafactor":
        return fact
    if name == "sm3":
        return fact + (numel if train.momentum > 0 else 0)
    raise PlanError(f"optimizer {name!r} is unknown to the planner")


def _local_opt_elems(train: Training, shape: ModelShape, local: int) -> tuple[int, int]:
    """(optimizer elements, parameter tensors) of an unsharded replica holding `local` params:
    exact for a whole model, scaled by local/total when tensor/pipeline parallelism splits it."""
    full = [s for _, s in shape.param_shapes()]
    if not full:
        if train.optimizer in ("adafactor", "sm3"):
            raise PlanError(f"optim.name={train.optimizer} factors each matrix by its rows and columns, "
                            "which a bare --params count does not give")
        return optimizer_elems(train, [], local, False), 0
    total = sum(math.prod(s) for s in full)
    elems = optimizer_elems(train, full, total, False)
    return ceil_div(elems * local, total), ceil_div(len(full) * local, total)


def model_states(shape: ModelShape, train: Training, lay: Layout, device: str = "cuda") -> dict[str, int]:
    """Bytes of params, grads, optimizer of the worst rank, as each engine's state_bytes() counts
    them (host copies included in their category), and `host`: the part in CPU memory."""
    check_layout(shape, train, lay)
    w = train.widths(lay.zero, lay.offload)
    sp = stage_params(shape, lay)
    local = max(sp["first"], sp["last"])
    steps = 4 if train.optimizer in ("adamw", "adafactor") else 0  # fp32 `step` scalar per tensor
    if lay.zero == 0:
        elems, n_tensors = _local_opt_elems(train, shape, local)
        opt = elems * 4 + local * w.master + steps * n_tensors
        return {"params": local * w.param, "grads": local * w.grad, "optimizer": opt, "host": 0,
                "gpu_params": local * w.param, "gpu_grads": local * w.grad, "gpu_optimizer": opt,
                "local_params": local, "shard": local, "padded": local}
    z = zero_summary(shape, train, lay, local)
    shard, pieces, padded = z["shard"], z["pieces"], z["padded"]
    params = shard * w.param if lay.zero == 3 else padded * w.param
    grads = shard * 4 + (padded * 4 if lay.zero == 1 else 0)  # fp32 shard (+ stage 1's full fp32 accumulator)
    host_grad = shard * 4 if lay.offload != "none" and device == "cuda" else 0
    opt = optimizer_elems(train, [], shard, True) * 4 + shard * w.master + steps * pieces
    host = (opt + host_grad if lay.offload != "none" else 0) + (params if lay.offload == "params" else 0)
    gpu = {"gpu_params": 0 if lay.offload == "params" else params, "gpu_grads": grads,
           "gpu_optimizer": 0 if lay.offload != "none" else opt}
    if device != "cuda":
        host = 0  # the engine reports host bytes only when there is a device to differ from
    return {"params": params, "grads": grads + host_grad, "optimizer": opt, "host": host, **gpu,
            "local_params": local, "shard": shard, "padded": padded}
