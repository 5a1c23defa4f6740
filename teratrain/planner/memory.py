"""Peak GPU memory of one rank, broken down as the ZeRO paper does (sec. 3): model states
(params, grads, optimizer) and residual states (activations, temporary buffers, fragmentation).

The peak is the largest of a few moments of a step, each the sum of what is alive then:
- forward end / loss backward: every saved activation, plus the (B*T, V) logits and their fp32
  copy (lm_loss upcasts), or the two fp32 (B*T, V) gradients the loss backward makes;
- first block's backward: the loss tensors are gone, the head's gradient exists, and one block's
  activation gradients (and a recomputed segment) are in flight;
- end of backward: gradients of every parameter, little activation left;
- optimizer step: params + grads + optimizer state, plus fp32 gradient copies for master weights.
A single-micro-batch LocalEngine, and ZeRO-2/3 (whose gradient shards are made by each step's first
reduction and freed by its update), allocate gradients while backward frees activations, so grads
and activations are never both whole; every other engine keeps grads (or their buckets) all along.
Under a pipeline the first and the last rank are evaluated each with its own stage's states and the
micro-batches its own action list holds (`_ends`). Model states come from states.py, saved tensors
from activations.py. Nothing is alive on the GPU
outside torch's allocator but the CUDA context; `allowance` adds it and fragmentation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from teratrain.models.chunked_loss import padded_vocab
from teratrain.parallel.flat import BLOCK_REDUCES_IN_FLIGHT, MAX_INFLIGHT_REDUCES
from teratrain.planner import activations as act
from teratrain.planner import weight_casts as wc
from teratrain.planner import compiled
from teratrain.planner import pipeline
from teratrain.planner.hardware import GPU, GPUS
from teratrain.planner.layout import Layout, ModelShape, Training, ceil_div
from teratrain.planner.states import model_states, stage_params, zero_summary

GIB = 2**30


@dataclass
class MemoryBreakdown:
    """Bytes per rank. params/grads/optimizer/activations/buffers are what each kind holds at its
    largest; `at_peak` is what is alive at the peak moment (`phase`), which sums to
    `peak_allocated`; `total` = peak_allocated + allowance is what must fit in the GPU."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    allowance: int
    total: int
    peak_allocated: int
    host: int
    phase: str
    at_peak: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)  # total allocated at each candidate moment
    terms: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def in_flight(lay: Layout) -> float:
    """Micro-batches whose activations the fullest pipeline rank holds at once, read off the
    simulated schedule (planner/pipeline.py): all m for GPipe (Huang et al. 2019), at most p for
    1F1B (Narayanan et al. 2021, PipeDream-flush) and ZB-H1, p + (p-1)/v stage-equivalents for
    interleaved 1F1B (Korthikanti et al. 2022, sec. 4.2.3)."""
    return pipeline.summary(lay)[1]


def _saved(shape: ModelShape, train: Training, lay: Layout, device: str, layers: int | None = None) -> dict[str, int]:
    """Saved bytes per micro-batch of the first and last stage, by kind, the blocks' for a rank of `layers`
    blocks (default: the first rank's, states.stage_params)."""
    w = train.widths(lay.zero, lay.offload)
    if not lay.keeps_shard:
        w = replace(w, keep_shard=False)
    T = shape.cfg.seq_len // lay.cp  # the positions a rank holds (context parallelism: its chunks)
    n = lay.tokens(shape.cfg.seq_len)
    kw = dict(device=device, tp=lay.tp, sp=lay.sequence_parallel, dropout=train.dropout, compress=train.compress,
              form=lay.tp_form)
    layers = stage_params(shape, lay)["layers"] if layers is None else layers
    # the blocks' tensors depend on these, the rest does not
    once = wc.casts_once(train, lay)  # the experts' stacks cast for the whole step, not per block
    bkw = {**kw, "form": lay.tp_form, "ep": lay.ep, "cp": lay.cp, "cp_form": lay.cp_form}
    blocks = act.stored_blocks(shape, w, layers, n, T, lay.recompute, lay.recompute_every, once, **bkw)
    pieces = act.loss_pieces(shape, train.loss_chunks, lay.tp, n)
    first = act.outside_saved(shape, w, n, T, first=True, last=lay.pp == 1, loss_pieces=pieces, **kw)
    last = act.outside_saved(shape, w, n, T, first=lay.pp == 1, last=True, loss_pieces=pieces, **kw)
    embed_side = act.outside_saved(shape, w, n, T, first=True, last=False, **kw)
    per_block = act.block_saved(shape, w, n, T, **bkw)
    where = compiled.scope(shape, train, lay)
    if where is not None:  # inductor's partition keeps fewer tensors than eager (planner/compiled.py)
        per_block = compiled.block_saved(shape, w, n, T, where, lay.recompute)
        blocks = {**blocks, "blocks": layers * sum(per_block.values())}
    loss_compiled = compiled.compiled_loss(shape, train, lay, pieces)
    if loss_compiled:
        first = compiled.outside_saved(shape, w, n, T, where, first=True, last=True)
        last, embed_side = first, compiled.outside_saved(shape, w, n, T, where, first=True, last=False)
    recompute = act.recompute_transient(shape, w, layers, n, T, lay.recompute, lay.recompute_every, **bkw)
    copies_block = wc.weight_copies(shape, w, lay.tp, lay.ep, lay.tp_form, device, once)
    casts = wc.step_cast_bytes(shape, w, layers, lay.tp, lay.ep, lay.tp_form, device) if once else 0
    # runs recorded while the layers held the carried gradients beside their sums (Training.carried_grads_held)
    held = train.carried_grads_held and wc.carries_grads(train, lay)
    carried = wc.carried_grad_bytes(shape, w, layers, lay.tp, lay.ep, lay.tp_form, device) if held else 0
    head_copy = act.head_weight_copy(shape, w, lay.tp, pieces, lay.pp)
    pending = act.pending_block(shape, w, n, T, **bkw)
    if pending is None:  # not read off the graph: a whole forward's tensors
        pending_blocks = blocks["blocks"]
    else:  # a recomputed segment's input stays with its holders (parallel/pipeline/saved.py) until W
        pending_blocks = layers * pending + (blocks["blocks"] if lay.recompute not in ("none", "selective") else 0)
    return {"blocks": blocks["blocks"], "copies": blocks["weight_copies"] + head_copy, "head_copy": head_copy,
            "pending_blocks": pending_blocks, "pending_last": act.pending_head(shape, w, n, **kw),
            "all_copies": layers * copies_block + head_copy,
            "first": sum(first.values()), "last": sum(last.values()), "log_softmax": last["log_softmax"],
            "embed_side": sum(embed_side.values()), "per_block": sum(per_block.values()) + copies_block,
            "recompute": recompute, "loss_compiled": loss_compiled, "step_casts": casts, "carried_held": carried,
            # what the first block still holds in its own backward: its activations, or where a segment is
            # replayed only the first segment's stored input (the replayed activations are `recompute`)
            "first_block": (sum(per_block.values()) + copies_block if not recompute
                            else blocks["blocks"] // max(1, act.segments(lay.recompute, layers, lay.recompute_every))),
            **{f"block.{k}": v for k, v in per_block.items()}}


def _layer_backward(shape: ModelShape, train: Training, lay: Layout) -> int:
    """Activation gradients in flight inside one block's backward: the MLP's (B*T, d_ff) gradients
    (SwiGLU: the product's, then silu-out's and w3x's, then w1x's; GELU: two), in the compute
    dtype, plus the fp32 residual-stream gradient and its copy."""
    c, w = shape.cfg, train.widths(lay.zero, lay.offload)
    n = lay.tokens(c.seq_len)
    hidden = shape.moe_hidden if shape.num_experts > 1 else c.ffn_dim  # per token: routed and shared experts
    split = lay.tp if lay.tp_form == "megatron" else 1  # the per-layer forms gather the MLP's hidden whole
    mlp = (3 if c.arch == "llama" else 2) * n * hidden * w.compute // split
    return mlp + 2 * n * c.d_model * 4 // (lay.tp if lay.sequence_parallel else 1)


def _engine_buffers(shape: ModelShape, train: Training, lay: Layout, st: dict) -> dict[str, int]:
    """Buffers of the engine that runs this layout (parallel/data.py, zero.py as of this writing):
    `gathered` all through forward and backward (ZeRO-3: the block in use, the prefetched one, the
    root group; under a pipeline the whole stage), `during` backward (flat reduce buffers in flight, gradients waiting for their group
    to complete), at the `end` of backward (the last, largest group) and `pending` until step()."""
    w = train.widths(lay.zero, lay.offload)
    red, k, dp = train.reduce_bytes, w.param, lay.replicas
    local = st["local_params"]
    out = {"gathered": 0, "during": 0, "end": 0, "pending": 0}
    if lay.zero == 0:  # buckets cast to the reduce dtype at the last micro-step, a few in flight at once
        if dp > 1 and red != w.grad:
            bucket = max(1, int(train.bucket_mb * 2**20) // w.grad)
            out["end"] = min(MAX_INFLIGHT_REDUCES + 1, ceil_div(local, bucket)) * min(bucket, local) * red
        return out
    z = zero_summary(shape, train, lay, local)
    g = train.grad_bytes
    if lay.zero == 1:  # reduced in place; in another reduce dtype, cast copies a few groups at a time
        if dp > 1 and red != g:
            out["end"] = min(MAX_INFLIGHT_REDUCES, z["groups"]) * z["typical"] * red
        return out
    # dp > 1: each completed group is flattened into a new reduce-dtype buffer, at most `in_flight` of
    # them alive (zero.py waits for the oldest first); the result lands in a shard-sized temporary
    # after the first micro-step, or when the shard's dtype differs. dp = 1 copies in place.
    in_flight = BLOCK_REDUCES_IN_FLIGHT if lay.zero == 3 else MAX_INFLIGHT_REDUCES
    flight = min(in_flight, z["groups"]) if dp > 1 else 0
    temp = red // dp if lay.num_microbatches > 1 or red != g else 0
    group = z["typical"] if lay.zero == 2 else z["block"]  # stage 2: bucket-sized groups; 3: blocks
    tied = shape.cfg.vocab_size * shape.cfg.d_model if shape.cfg is not None and shape.cfg.tie_embeddings else 0
    if lay.zero == 2:  # a tied embedding's gradient exists from the head's backward to the end
        out["during"] = flight * group * (red + temp) + group * k + tied * k
        out["end"] = z["biggest"] * (k + (red + temp if dp > 1 else 0)) + max(0, flight - 1) * group * red
        return out
    if lay.pp > 1:  # the stage stays gathered all step; fp32 accumulators reduced once, cast if need be
        out["gathered"] = (z["all_padded"] - z["float8_padded"]) * k + z["float8_padded"]  # float8 in 1 byte
        out["end"] = min(MAX_INFLIGHT_REDUCES + 1, z["groups"]) * group * red if dp > 1 and red != 4 else 0
        return out
    root, held = z["root"], min(2, z["blocks"])  # current + prefetched block, root group; float8 weights in 1 byte
    out["gathered"] = (held * (group - z["block_float8"]) + root) * k + held * z["block_float8"]
    out["during"] = flight * group * (red + temp) + group * k + root * k  # the root's grads live all backward
    out["end"] = root * (k + (red + temp if dp > 1 else 0)) + max(0, flight - 1) * group * red
    return out


def _by_end(shape: ModelShape, train: Training, lay: Layout, device: str, saved: dict) -> dict[bool, dict]:
    """`saved` of each pipeline end (False: the first, True: the last), the blocks' of the rank that end
    follows (pipeline.end_layers: its own count where `parallel.stage_layers` splits unevenly)."""
    made = {stage_params(shape, lay)["layers"]: saved}  # by block count: the search plans thousands of splits
    out = {}
    for last in (False, True):
        n = pipeline.end_layers(lay, last)
        if n is not None and n not in made:
            made[n] = _saved(shape, train, lay, device, n)
        out[last] = saved if n is None else made[n]
    return out


def _ends(shape: ModelShape, lay: Layout, by_end: dict[bool, dict], grads: int = 0) -> list[dict]:
    """The ranks whose peak can be the job's: one without a pipeline; with one, the first and the last
    pipeline rank (a middle rank holds no more micro-batches than the first in any of our schedules,
    and no embedding, head or loss). Each end: its share of the fuller stage's model states (states.py
    counts the fuller stage; state bytes are linear in the parameters), and the moment of its own
    action list at which its saved tensors are largest (pipeline.end_held: GPipe's last rank holds all
    m micro-batches with their logits, 1F1B's only one). `grads`: the fuller stage's gradient bytes
    that appear chunk by chunk with their first backward (no buffer holds them before: `_no_buffer`),
    weighed in when choosing that moment; the end says what share of them exists then (`made`)."""
    if lay.pp == 1:
        made = pipeline.end_held(lay, True)[0][4]
        return [{"scale": 1.0, "k": 1.0, "ends": 1, "last": True, "first": True, "split": False, "k_pend": 0,
                 "e_pend": 0, "made": made}]
    sp = stage_params(shape, lay)
    fuller = max(sp["first"], sp["last"])
    out = []
    for last in (False, True):
        saved = by_end[last]
        split = last and pipeline.splits_backward(lay)  # (the first stage runs whole backwards: runtime.py)
        copies = 0 if split else saved["copies"] - saved["head_copy"]  # split: one shared set (saved.py)
        extra = saved["last"] + (0 if split else saved["head_copy"]) if last else saved["first"]
        per_stage = saved["blocks"] + copies
        pend_end = saved["pending_last"] if split else 0

        scale = sp["last" if last else "first"] / fuller

        def held(h):
            return (h[0] * per_stage + h[1] * extra + h[2] * saved["pending_blocks"] + h[3] * pend_end
                    + h[4] * grads * scale)

        k, e, k_pend, e_pend, made = max(pipeline.end_held(lay, last), key=held)
        out.append({"scale": scale, "k": k, "ends": e, "last": last, "first": not last, "split": split,
                    "k_pend": k_pend if split else 0, "e_pend": e_pend if split else 0, "made": made})
    return out


def _phases(shape, train, lay, st, by_end, eng) -> dict[str, dict[str, int]]:
    """What is alive at each candidate peak moment, by kind (of each pipeline end: `_ends`)."""
    ends = _ends(shape, lay, by_end, st["gpu_grads"] if _no_buffer(train, lay) else 0)
    out = {}
    for end in ends:
        name = "" if len(ends) == 1 else (" (last stage)" if end["last"] else " (first stage)")
        for phase, kinds in _end_phases(shape, train, lay, st, by_end[end["last"]], eng, end).items():
            out[phase + name] = kinds
    return out


def _end_phases(shape, train, lay, st, saved, eng, end: dict) -> dict[str, dict[str, int]]:
    """What is alive at each candidate peak moment on one pipeline end (or the one rank), by kind."""
    w = train.widths(lay.zero, lay.offload)
    c = shape.cfg
    n = lay.tokens(c.seq_len)
    V = c.vocab_size
    ends, last, scale = end["ends"], end["last"], end["scale"]
    one_pass = lay.pp == 1 and lay.num_microbatches == 1
    # Gradients with no group to reduce them are made by each chunk's first backward (`_no_buffer`);
    # so where the fullest moment comes before any (one pass, GPipe, 1F1B's first rank at m = p) they
    # are not there, and an interleaved rank has only its backward-run chunks' then. A tied embedding
    # split over a pipeline's two ends keeps its bucket, reduced over the ends at the step. Not counted:
    # ZB-H1's last stage makes an untied head's gradient in I (stage.grad_in_i), before its first W.
    no_buffer = _no_buffer(train, lay)
    tied_kept = V * c.d_model * w.grad // lay.tp if no_buffer and lay.pp > 1 and c.tie_embeddings else 0
    progressive = (one_pass and lay.zero >= 2) or (no_buffer and end["made"] == 0)
    grads_held = int(st["gpu_grads"] * scale)
    grads_now = max(tied_kept, int(grads_held * end["made"])) if no_buffer else grads_held
    base = {"params": int(st["gpu_params"] * scale), "optimizer": int(st["gpu_optimizer"] * scale),
            "grads": tied_kept if progressive else grads_now}
    module = act.rope_tables(shape) + eng["gathered"] + saved["step_casts"]  # all through the micro-batches
    S, copies, fwd_copies = _held_at(saved, end)
    pieces = act.loss_pieces(shape, train.loss_chunks, lay.tp, n)
    if saved["loss_compiled"]:  # inductor's fused passes over the logits it keeps (planner/compiled.py)
        loss_fwd, loss_bwd = compiled.loss_buffers(shape, w, n)
    elif pieces > 1:  # chunked (models/chunked_loss.py): one piece's logits, fp32 copy and gradient, its fp32 dW
        # accumulator and the weight's cast, over the vocabulary padded for the GEMMs (and the padded weight's
        # copy where padding was needed); backward, the scaled dh and dW
        Vp = padded_vocab(V)
        loss_fwd = -(-n // pieces) * Vp * (2 * w.compute + 8) + Vp * c.d_model * 4 + V * c.d_model * w.compute
        loss_fwd += Vp * c.d_model * w.compute if Vp != V else 0
        loss_bwd = (n + V) * c.d_model * w.compute
    elif lay.tp == 1:  # lm_loss: the logits and their fp32 copy; backward, fp32 grads of log_softmax's two ends
        # (the logits over the rows the head multiplies: act.head_rows)
        loss_fwd = n * act.head_rows(shape, lay.tp, lay.pp) * w.compute + (n * V * 4 if w.compute != 4 else 0)
        loss_bwd = 2 * n * V * 4
    else:  # the vocab-parallel loss (tp_layers.py) writes its fp32 softmax (the saved tensor) straight
        # from the logits and turns it into the gradient in place, cast to the logits' dtype
        loss_fwd = loss_bwd = n * V * w.compute // lay.tp
    loss_fwd, loss_bwd = (loss_fwd, loss_bwd) if last else (0, 0)
    head_grad = 0  # what exists of the gradients when the first block's backward starts
    if progressive and lay.zero == 0 and last and not tied_kept:
        head_grad = V * c.d_model * w.grad // lay.tp
    elif progressive and lay.zero == 2:  # the head's bucket is reduced at once; ZeRO-3 reduces the root last
        head_grad = ceil_div(V * c.d_model // lay.tp, lay.replicas) * train.grad_bytes
    T_layer = _layer_backward(shape, train, lay) + saved["recompute"]
    log_softmax = saved["log_softmax"] * ends if last else 0
    at_once = int(st["gradients_at_once"] * scale)
    carried_held = saved["carried_held"] if not at_once else 0  # compiled whole, at_once counts them
    embed_side = saved["embed_side"] if end["first"] else 0
    return {
        "forward end": {**base, "activations": S, "buffers": module + fwd_copies + loss_fwd},
        # before any parameter's gradient exists: the engines' reduce buffers come with the blocks'
        "loss backward": {**base, "activations": S, "buffers": module + copies + loss_bwd},
        "first block backward": {**base, "grads": base["grads"] + head_grad, "activations": S - log_softmax,
                                 "buffers": module + copies + T_layer + eng["during"]},
        "end of backward": {**base, "grads": grads_held + at_once + carried_held,
                            "activations": embed_side + saved["first_block"],
                            "buffers": module + T_layer + eng["end"] + eng["pending"]},
        "optimizer step": {**base, "grads": grads_held, "activations": 0,
                           "buffers": act.rope_tables(shape) + eng["pending"]
                                      + _step_temporaries(shape, train, lay, st)},
    }


def _gradients_at_once(train: Training, lay: Layout, st: dict) -> int:
    """compiled.gradients_at_once of the gradients this rank's backward makes, before any reduction."""
    made = st["gpu_grads"] if lay.zero == 0 else st["local_params"] * train.widths(lay.zero, lay.offload).grad
    return compiled.gradients_at_once(train, lay, made, not _no_buffer(train, lay))


def _no_buffer(train: Training, lay: Layout) -> bool:
    """Gradients with no group to reduce them (zero 0 at dp 1: tp or pp alone) are autograd's, made in
    the first backward and freed after the step (parallel/data.py); CUDA graphs keep every buffer
    (their pools: not modelled)."""
    return lay.zero == 0 and lay.replicas == 1 and not train.graphed


def _held_at(saved: dict, end: dict) -> tuple[int, int, int]:
    """At the fullest moment of one pipeline end (`_ends`): the saved activations (in flight, and
    waiting for W), the autocast weight copies held, and those alive during a forward."""
    last = end["last"]
    head_copy = saved["head_copy"] if last else 0
    own_end = saved["last"] if last else saved["first"]
    S = int(end["k"] * saved["blocks"] + end["ends"] * own_end + end["k_pend"] * saved["pending_blocks"]
            + end["e_pend"] * saved["pending_last"])
    block_copies = saved["copies"] - saved["head_copy"]
    running = saved["all_copies"] - saved["head_copy"] + head_copy
    if end["split"]:  # one set shared by the step's micro-batches; the running forward casts its own first
        return S, block_copies + head_copy, block_copies + head_copy + running
    copies = int(end["k"] * block_copies + end["ends"] * head_copy)
    # autocast caches every weight cast until the forward's autocast context exits, even under
    # checkpointing (the recomputed segments cast again in backward): the running micro-batch holds all
    return S, copies, running + copies - (block_copies + head_copy)


def held_for_backward(shape: ModelShape, train: Training, lay: Layout, device: str = "cuda") -> dict[str, int]:
    """Bytes each end of a pipeline ("first", "last") holds for its backward passes at its fullest
    moment between two actions: saved activations in flight, ZB-H1's state waiting for W, autocast's
    weight copies (what bench/pipeline_live.py counts, live, after each action)."""
    by_end = _by_end(shape, train, lay, device, _saved(shape, train, lay, device))
    return {("last" if end["last"] else "first"): sum(_held_at(by_end[end["last"]], end)[:2])
            for end in _ends(shape, lay, by_end)}


def _step_temporaries(shape: ModelShape, train: Training, lay: Layout, st: dict) -> int:
    """LocalEngine/DataParallelEngine with masters: fp32 copies of every gradient for the step
    (optim/engine.py:_fp32_grads). ZeRO with fp32 gradients updates from the shards themselves; with
    bf16 ones, from an fp32 copy of one group's shard at a time."""
    w = train.widths(lay.zero, lay.offload)
    if lay.zero == 0 and w.master:
        local = st["local_params"]
        return local * 4 - (local * w.grad if lay.replicas == 1 else 0)  # LocalEngine frees the low-precision grads
    if lay.zero >= 1 and train.grad_bytes != 4 and lay.offload == "none":
        z = zero_summary(shape, train, lay, st["local_params"])
        return ceil_div(z["biggest"], lay.replicas) * 4
    return 0


def plan_memory(shape: ModelShape, train: Training, lay: Layout, gpu: GPU | None = None,
                device: str = "cuda") -> MemoryBreakdown:
    """Per-rank memory of `lay` (worst pipeline stage), peak moment and allowance included."""
    gpu = gpu or GPUS["h100"]
    st = model_states(shape, train, lay, device)
    versions = pipeline.summary(lay)[2]  # asynchronous pipelines stash older copies of the stage's weights
    st = {**st, "gpu_params": st["gpu_params"] * versions}
    st["gradients_at_once"] = _gradients_at_once(train, lay, st)
    eng = _engine_buffers(shape, train, lay, st)
    if shape.is_bare:
        phases = {"optimizer step": {"params": st["gpu_params"], "optimizer": st["gpu_optimizer"],
                                     "grads": st["gpu_grads"], "activations": 0,
                                     "buffers": eng["pending"] + _step_temporaries(shape, train, lay, st)}}
        saved = {}
    else:
        saved = _saved(shape, train, lay, device)
        phases = _phases(shape, train, lay, st, _by_end(shape, train, lay, device, saved), eng)
    phase, at_peak = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    peak = sum(at_peak.values())
    allowance = int(gpu.context_gib * GIB + gpu.fragmentation * peak)
    acts = max(p["activations"] for p in phases.values())
    bufs = max(p["buffers"] for p in phases.values())
    terms = {k: v for k, v in saved.items() if k.startswith("block.")}
    terms.update({"local_params": st["local_params"], "shard_params": st["shard"],
                  "saved_per_microbatch_first_stage": saved.get("blocks", 0) + saved.get("first", 0),
                  "autocast_weight_copies": saved.get("copies", 0), "recompute_segment": saved.get("recompute", 0),
                  "step_casts": saved.get("step_casts", 0),
                  "gradients_at_once": 0 if shape.is_bare else st["gradients_at_once"],
                  "in_flight_microbatches": in_flight(lay), "weight_versions": versions,
                  **{f"engine_{k}": v for k, v in eng.items()}})
    return MemoryBreakdown(params=st["gpu_params"], grads=st["gpu_grads"], optimizer=st["gpu_optimizer"],
                           activations=acts, buffers=bufs, allowance=allowance, total=peak + allowance,
                           peak_allocated=peak, host=st["host"], phase=phase, at_peak=at_peak,
                           phases={k: sum(v.values()) for k, v in phases.items()}, terms=terms)


def least_total(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, device: str = "cuda") -> float:
    """A floor under plan_memory(...).total from the model states alone: the fuller rank's parameters and
    optimizer states are alive at every moment `_end_phases` weighs, and the allowance adds the context and
    fragmentation on top of the peak. Cheap: it lets a search skip layouts whose states alone overfill a GPU."""
    st = model_states(shape, train, lay, device)
    return gpu.context_gib * GIB + (1 + gpu.fragmentation) * (st["gpu_params"] + st["gpu_optimizer"])


def forward_saved(shape: ModelShape, train: Training, lay: Layout, device: str = "cuda") -> int:
    """Bytes one micro-batch's forward keeps for backward on a rank of a layout without a pipeline,
    as `saved_tensors_hooks` count them (measure.saved_bytes, parameters excluded): the
    blocks' and the two ends' saved tensors and the autocast weight copies, and (fp32 compute, no
    segment recomputation) the RoPE tables SDPA's inputs are views of (under context parallelism, the
    copies of this rank's rows of them); the whole model compiled in one graph keeps the tables too
    (planner/compiled.py)."""
    saved = _saved(shape, train, lay, device)
    total = saved["blocks"] + saved["first"] + saved["copies"]
    tables = train.widths(lay.zero, lay.offload).compute == 4 or compiled.scope(shape, train, lay) == "model"
    if tables and lay.recompute in ("none", "selective"):
        total += act.rope_tables(shape) // lay.cp  # context parallelism: the rows of this rank's positions, copied
    return total
