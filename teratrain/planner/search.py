"""Pick a layout: enumerate the degrees the user left unset, drop what does not fit, rank by time.

Search space (each dimension only where the user did not fix it):
- dp x cp x tp x pp = GPUs; tp within a node and dividing the query and key/value heads and d_ff
  (Megatron-LM's split); pp up to the layer count, the blocks split unevenly where they do not divide
  (pipeline.planned_split: the slowest stage, head included, as fast as block counts allow;
  `parallel.stage_layers` when given); ep dividing dp and the experts (1 for dense models);
- the schedule, where the user left it unset: 1F1B, and interleaved 1F1B at v = 2, 4, 8 virtual
  stages and every v up to 8 that splits the blocks evenly over pp x v chunks (Narayanan et al. 2021
  sec. 2.2: a bubble of (p-1)/(v m) of the ideal for v times the sends, and p + (p-1)/v stages'
  activations in flight); with interleaved-1f1b set, v where unset;
  cp (both forms, ring and all-to-all) for sequences of at least CP_MIN_SEQ tokens, where it splits
  them into 2 x cp x tp equal pieces (shorter ones: cp = 1 unless fixed);
- ZeRO stage 0-3, offload (optimizer with stage >= 1, params with stage 3);
- micro-batch (a divisor of the per-replica batch, up to 64 sequences) and recomputation policy;
- sequence parallelism is on whenever tp > 1 (same traffic as tp, less memory: Korthikanti et al.),
  unless the user turned it off or chose a per-layer form (parallel.tp_form=all-gather / all-reduce).
A layout fits when its predicted total (peak + allowance) is at most the GPU memory and, when it
offloads, the pinned host memory of the GPUs one node holds (host bytes per GPU x GPUs per node) is
at most the host's memory (`host_mem_gib`; None: not checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from teratrain.config_schema import SELECTIVE_OPS
from teratrain.parallel.tp_plan import splits_kv_heads
from teratrain.planner.hardware import GPU
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.memory import GIB, MemoryBreakdown, least_total, plan_memory
from teratrain.planner.pipeline import planned_split
from teratrain.planner.states import PlanError, check_layout
from teratrain.planner.time import TimeBreakdown, plan_time

SEARCHED = ("dp", "tp", "pp", "ep", "cp", "cp_form", "zero", "offload", "micro_batch", "recompute", "schedule",
            "virtual_stages")
VIRTUAL_STAGES = (2, 4, 8)  # interleaving tried at these chunk counts per rank
# Context parallelism is searched from this sequence length on: below it (4 chunks of 2,048 tokens at
# cp=2) a chunk is too short for the ring's transfers to hide under its attention on any GPU we plan.
CP_MIN_SEQ = 8192
CP_FORMS = ("ring", "all-to-all")
# memory.recompute policies tried, least recomputed first; the per-op ones only for dense models: an MoE layer's
# kept outputs are counted (planner/activations.py ops_saved), but not what its replay reruns (the router, top-k
# and the permutations: planner/replay.py prices a dense block's), and the config refuses the alternate one there
RECOMPUTE_SEARCHED = ("none", "selective", "selective-ops", "selective-ops-alternate", "sqrt", "full")
MAX_MICRO_BATCH = 64
OFFLOADS = ("none", "optimizer", "params")


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool  # on the GPU and on the host
    host_fits: bool = True  # the pinned host memory of one node's GPUs fits the host

    def host_per_node(self, gpu: GPU) -> int:
        """Pinned host bytes of the GPUs of this layout that share one node."""
        return self.memory.host * gpus_per_node(self.layout, gpu)

    def sort_key(self) -> tuple:
        # fastest first (to 0.1%); among equals the simpler layout (no offload, fewer stages, a lower ZeRO
        # stage, less recomputation), then less communication, then less memory
        lay = self.layout
        simpler = (OFFLOADS.index(lay.offload), lay.pp, lay.zero,
                   RECOMPUTE_SEARCHED.index(lay.recompute) if lay.recompute in RECOMPUTE_SEARCHED else 0)
        return (not self.fits, float(f"{self.time.step_time_s:.3g}"), simpler, self.time.comm_s, self.memory.total)


def gpus_per_node(lay: Layout, gpu: GPU) -> int:
    """GPUs of this layout on one node: all of them up to a node's worth."""
    return min(lay.gpus, gpu.gpus_per_node)


def evaluate(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, gpu_mem_gib: float | None = None,
             host_mem_gib: float | None = None, device: str = "cuda") -> Candidate:
    mem = plan_memory(shape, train, lay, gpu, device)
    return Candidate(lay, mem, plan_time(shape, train, lay, gpu, mem), *_fit(mem, lay, gpu, gpu_mem_gib, host_mem_gib))


def _fit(mem: MemoryBreakdown, lay: Layout, gpu: GPU, gpu_mem_gib: float | None,
         host_mem_gib: float | None) -> tuple[bool, bool]:
    """(fits the GPU and the host, fits the host): a node's ranks share its host memory."""
    cap = (gpu_mem_gib if gpu_mem_gib is not None else gpu.memory_gib) * GIB
    host_ok = host_mem_gib is None or mem.host * gpus_per_node(lay, gpu) <= host_mem_gib * GIB
    return mem.total <= cap and host_ok, host_ok


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(c, tp: int, form: str = "megatron") -> bool:
    """Whether tensor parallelism of degree `tp` splits this model's heads and MLP (parallel/tp_plan.py
    check_tp): in the megatron form key/value heads fewer than tp are replicated, one whole head a rank."""
    return splits_kv_heads(c.kv_heads, tp, form) and not (c.n_heads % tp or c.ffn_dim % tp)


def _degrees(shape: ModelShape, gpus: int, gpu: GPU, fixed: dict) -> list[tuple[int, int, int, int, int]]:
    """(dp, tp, pp, ep, cp) with dp*cp*tp*pp = gpus that the model's shape allows; ep divides dp and the
    experts (expert parallelism borrows data-parallel ranks)."""
    c = shape.cfg
    out = []
    for tp in [fixed["tp"]] if "tp" in fixed else _divisors(min(gpus, gpu.gpus_per_node)):
        if c is not None and not _splits(c, tp, fixed.get("tp_form", "megatron")):
            continue
        for pp in [fixed["pp"]] if "pp" in fixed else _divisors(gpus // tp if gpus % tp == 0 else 1):
            if c is not None and c.n_layers < pp and "pp" not in fixed:
                continue
            if shape.is_bare and (tp > 1 or pp > 1) and not ("tp" in fixed or "pp" in fixed):
                continue  # a bare count has no layers to split: data parallel + ZeRO only
            if gpus % (tp * pp):
                continue
            for cp in _cps(shape, gpus // (tp * pp), fixed):
                dp = gpus // (tp * pp * cp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                eps = [fixed["ep"]] if "ep" in fixed else _divisors(shape.num_experts)
                out += [(dp, tp, pp, ep, cp) for ep in eps if dp % ep == 0]
    return out


def _cps(shape: ModelShape, ranks: int, fixed: dict) -> list[int]:
    """Context-parallel degrees to try among `ranks` (what tp and pp leave): the fixed one, or every
    divisor for a sequence of at least CP_MIN_SEQ tokens (the layout check drops those that do not
    split it), else 1."""
    if "cp" in fixed:
        return [fixed["cp"]] if ranks % fixed["cp"] == 0 else []
    if shape.is_bare or shape.cfg.seq_len < CP_MIN_SEQ:
        return [1]
    return _divisors(ranks)


def layouts(shape: ModelShape, train: Training, gpus: int, gpu: GPU, fixed: dict, refused: list | None = None):
    """Every layout of the search space consistent with `fixed` (a dict of Layout fields); why the
    others were refused is appended to `refused`."""
    for dp, tp, pp, ep, cp in _degrees(shape, gpus, gpu, fixed):
        per_replica = 1 if shape.is_bare else train.global_batch // dp  # a bare count has no batch
        if per_replica == 0 or (train.global_batch % dp and not shape.is_bare):
            continue
        mbs = [fixed["micro_batch"]] if "micro_batch" in fixed else \
            [1] if shape.is_bare else [b for b in _divisors(per_replica) if b <= MAX_MICRO_BATCH]
        if "num_microbatches" in fixed:  # parallel.num_microbatches set: the micro-batch follows from it
            mb, rest = divmod(per_replica, fixed["num_microbatches"])
            mbs = [mb] if mb and not rest and fixed.get("micro_batch", mb) == mb else []
        zeros = [fixed["zero"]] if "zero" in fixed else [0, 1, 2, 3]
        offloads = [fixed["offload"]] if "offload" in fixed else list(OFFLOADS)
        recomputes = [fixed["recompute"]] if "recompute" in fixed else \
            (["none"] if shape.is_bare else [r for r in RECOMPUTE_SEARCHED
                                            if r not in SELECTIVE_OPS or shape.num_experts == 1])
        forms = [fixed.get("cp_form", "ring")] if cp == 1 or "cp_form" in fixed else list(CP_FORMS)
        for zero, offload, form in ((z, o, f) for z in zeros for o in offloads for f in forms):
            if dp * cp == 1 and zero and offload == "none" and "zero" not in fixed:
                continue  # one replica: a ZeRO engine only helps to offload
            for mb in mbs:
                if per_replica % mb:
                    continue
                for rc, (sched, v) in ((r, p) for r in recomputes for p in _pipelines(shape, pp, fixed)):
                    base = {k: v for k, v in fixed.items() if k in Layout.__dataclass_fields__}
                    base.update(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, cp_form=form, zero=zero, offload=offload,
                                micro_batch=mb, recompute=rc, num_microbatches=per_replica // mb,
                                sequence_parallel=tp > 1 and fixed.get("sequence_parallel", True),
                                schedule=sched, virtual_stages=v, stage_layers=tuple(fixed.get("stage_layers", ())))
                    lay = Layout(**base)
                    try:
                        check_layout(shape, train, lay)
                    except PlanError as e:
                        if refused is not None:
                            refused.append(str(e))
                        continue
                    yield lay if lay.stage_layers else lay.with_(stage_layers=planned_split(shape, lay))


def _pipelines(shape: ModelShape, pp: int, fixed: dict) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try at `pp`: the fixed ones, else 1F1B and interleaved 1F1B at
    VIRTUAL_STAGES (v where pp x v stages each get a block, but for the model's first and last: the
    embedding and the head may run alone) and at each v up to their largest that splits
    the blocks evenly (3 for 105 blocks on 35 stages); check_layout drops micro-batch counts the
    interleaved schedule refuses."""
    sched, v = fixed.get("schedule"), fixed.get("virtual_stages")
    if pp == 1:
        return [(sched or "one_f_one_b", v or 1)]
    if sched is None and v is not None:
        return [("interleaved_1f1b", v)] if v > 1 else [("one_f_one_b", 1)]
    if sched is not None and (sched != "interleaved_1f1b" or v is not None):
        return [(sched, v or 1)]
    n = shape.cfg.n_layers if shape.cfg is not None else pp
    # the model's first and last stage may hold no block; and every v that splits the blocks evenly
    vs = sorted({k for k in VIRTUAL_STAGES if pp * k <= n + 2}
                | {k for k in range(2, max(VIRTUAL_STAGES) + 1) if n % (pp * k) == 0})
    return ([] if sched else [("one_f_one_b", 1)]) + [("interleaved_1f1b", k) for k in vs]


def search(shape: ModelShape, train: Training, gpus: int, gpu: GPU, fixed: dict,
           gpu_mem_gib: float | None = None, host_mem_gib: float | None = None,
           device: str = "cuda") -> list[Candidate]:
    """Every candidate layout, fitting ones first, each group fastest first."""
    refused: list[str] = []
    cands, plain = [], {}  # plain: the 1F1B candidate of each layout, by the layout interleaving varies
    # layouts whose selective-ops candidate fits: there the alternate policy, which keeps less and replays more
    # (the same ops and bytes, its products besides), cannot be faster (layouts tries selective-ops first)
    per_op_fits = set()
    for lay in layouts(shape, train, gpus, gpu, fixed, refused):
        key = lay.with_(schedule="one_f_one_b", virtual_stages=1, stage_layers=())
        if lay.virtual_stages > 1 and key in plain and not _may_interleave(plain[key]):
            continue
        if lay.recompute == "selective-ops-alternate" and lay.with_(recompute="selective-ops", stage_layers=()) \
                in per_op_fits:
            continue
        cands.append(evaluate(shape, train, lay, gpu, gpu_mem_gib, host_mem_gib, device))
        if lay.virtual_stages == 1:
            plain[key] = cands[-1]
        if lay.recompute == "selective-ops" and cands[-1].fits:
            per_op_fits.add(lay.with_(stage_layers=()))
    if not cands:
        raise PlanError(_why_empty(shape, train, gpus, fixed, refused))
    return sorted(cands, key=Candidate.sort_key)


def _may_interleave(plain: Candidate) -> bool:
    """Can interleaving beat this 1F1B candidate? Not where it does not fit (interleaved 1F1B holds
    the same states and more activations: p + (p-1)/v stages' worth against p), nor where its bubble is
    under 1% of the step (interleaving saves part of the bubble only, and adds sends)."""
    return plain.fits and plain.time.bubble_s > 0.01 * plain.time.step_time_s


def _why_empty(shape: ModelShape, train: Training, gpus: int, fixed: dict, refused: list[str]) -> str:
    """One sentence naming the key that rules every layout out, and the fix."""
    c = shape.cfg
    tp = fixed.get("tp")
    form = fixed.get("tp_form", "megatron")
    if c is not None and tp and not _splits(c, tp, form):
        ok = [d for d in _divisors(min(gpus, 64)) if _splits(c, d, form)]
        multiple = " or be a multiple of it" if form == "megatron" else ""
        return (f"parallel.tp={tp} must divide model.n_heads ({c.n_heads}) and the MLP width ({c.ffn_dim}), and "
                f"divide model.n_kv_heads ({c.kv_heads}){multiple}; set parallel.tp to one of "
                f"{', '.join(map(str, ok))}.")
    prod = math.prod(fixed.get(k, 1) for k in ("dp", "cp", "tp", "pp"))
    if "ep" in fixed and (fixed.get("dp", gpus // max(1, prod)) % fixed["ep"] or shape.num_experts % fixed["ep"]):
        return (f"parallel.ep={fixed['ep']} must divide the data-parallel degree and model.moe.num_experts "
                f"({shape.num_experts}); choose an ep that divides both.")
    if gpus % prod or ("dp" in fixed and prod != gpus):
        return (f"the fixed degrees multiply to {prod}, which does not {'equal' if 'dp' in fixed else 'divide'} "
                f"--gpus {gpus}; change --gpus or the parallel.* degrees.")
    if refused:  # every layout the degrees allow was refused for the same kind of reason: say the first
        return f"no layout of {gpus} GPU(s) can run: {refused[0]}."
    fx = ", ".join(f"{k}={v}" for k, v in fixed.items() if k in SEARCHED)
    return (f"no layout of {gpus} GPU(s) satisfies the fixed settings ({fx or 'none'}) with "
            f"train.global_batch={train.global_batch}; make the degrees multiply to --gpus and divide "
            "the global batch, or unset some of them.")


def smallest_gpu_count(shape: ModelShape, train: Training, gpus: int, gpu: GPU, fixed: dict,
                       gpu_mem_gib: float, limit: int = 4096, host_mem_gib: float | None = None) -> int | None:
    """The fewest GPUs above `gpus` at which some layout fits, or None up to `limit`: doubling from `gpus` finds
    a count that fits, then the counts between it and the last that did not are tried in order (every count
    within two nodes, whole nodes beyond). Memory alone decides: each count stops at its first fitting layout,
    and no step time is planned."""
    free = {k: v for k, v in fixed.items() if k not in ("dp",)}
    cap = gpu_mem_gib * GIB

    def fits(n: int) -> bool:
        t = Training(**{**train.__dict__, "global_batch": max(train.global_batch, n)})  # a rank needs a sequence
        return any(_fit(plan_memory(shape, t, lay, gpu), lay, gpu, gpu_mem_gib, host_mem_gib)[0]
                   for lay in layouts(shape, t, n, gpu, free) if least_total(shape, t, lay, gpu) <= cap)

    low, n = gpus, gpus * 2
    while n <= limit and not fits(n):
        low, n = n, n * 2
    if n > limit:
        return None
    node = gpu.gpus_per_node
    between = [k for k in range(low + 1, n) if k <= 2 * node or k % node == 0]
    return next((k for k in between if fits(k)), n)


def batch_advice(lr: float, rule: str, base_batch: int | None, global_batch: int, warmup: int) -> dict | None:
    """LR and warmup for a global batch other than the one the LR was tuned at (optim/lr.py)."""
    from teratrain.optim.lr import scaled_lr, suggested_warmup

    if base_batch is None or base_batch == global_batch:
        return None
    rules = {r: scaled_lr(lr, r, base_batch, global_batch) for r in ("linear", "sqrt")}
    return {"base_batch": base_batch, "global_batch": global_batch, "base_lr": lr, "rule": rule,
            "lr_linear": rules["linear"], "lr_sqrt": rules["sqrt"],
            "lr": rules.get(rule, rules["sqrt"]),
            "warmup_steps": suggested_warmup(global_batch, base_batch, warmup),
            "ratio": global_batch / base_batch, "log2_ratio": math.log2(global_batch / base_batch)}
