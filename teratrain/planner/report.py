"""How `teratrain plan` shows a plan: a table whose every line says what it counts, or one JSON object."""

from __future__ import annotations

from teratrain.parallel.pipeline.schedules import config_name
from teratrain.planner.hardware import GPU
from teratrain.planner.layout import ModelShape, Training
from teratrain.planner.memory import GIB
from teratrain.planner.modes import mode_of
from teratrain.planner.search import Candidate, gpus_per_node
from teratrain.planner.time import FP8_HOST_OP_SHARE, launch_s

OPT_BYTES = {"adamw": "AdamW m + v (8 B/param)", "sgd": "SGD momentum (4 B/param)",
             "adafactor": "Adafactor row + column sums", "sm3": "SM3 row + column accumulators"}


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f}"


def _layout_str(lay) -> str:
    s = f"dp={lay.dp} tp={lay.tp} pp={lay.pp} ep={lay.ep} zero={lay.zero} micro_batch={lay.micro_batch} " \
        f"recompute={lay.recompute} offload={lay.offload}"
    s += f" schedule={_schedule_str(lay)}" if lay.pp > 1 else ""
    s += f" cp={lay.cp} cp_form={lay.cp_form}" if lay.cp > 1 else ""
    return s + (" sequence_parallel" if lay.sequence_parallel else "")


def _schedule_str(lay) -> str:
    name = config_name(lay.schedule)
    return name + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")


def split_str(counts) -> str:
    """Blocks per stage, runs of one count shortened: 7/8x14/7, 0/1x126/0."""
    runs: list[list[int]] = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "/".join(f"{n}x{k}" if k > 2 else "/".join([str(n)] * k) for n, k in runs)


def memory_lines(shape: ModelShape, train: Training, gpu: GPU, c: Candidate) -> list[tuple[str, int, int, str]]:
    """(name, held bytes, bytes at the peak, explanation) per kind."""
    lay, m = c.layout, c.memory
    w = train.widths(lay.zero, lay.offload)
    local = m.terms["local_params"]
    dp = f"1/dp of them (ZeRO-{lay.zero}, dp={lay.dp})" if lay.cp == 1 else \
        f"1/(dp x cp) of them (ZeRO-{lay.zero}, dp={lay.dp}, cp={lay.cp})"
    if lay.ep > 1:
        dp = dp[:-1] + f"; experts 1/(dp/ep), ep={lay.ep})"
    params = f"{local / 1e9:.3g} B params on this rank x {w.param} B" + (f"; {dp}" if lay.zero == 3 else "")
    if lay.zero == 3 and lay.offload == "none" and not m.params and local:  # gathers cast the masters (states.py)
        params = (f"no low-precision copy of the {local / 1e9:.3g} B params on this rank: each gather casts the fp32 "
                  f"masters (optimizer state), {dp}")
    if lay.ep > 1:
        params += f"; 1/{lay.ep} of the experts"
    if lay.offload == "params":
        params += "; the shard lives in CPU memory"
    if m.terms.get("weight_versions", 1) > 1:
        params += f"; x {m.terms['weight_versions']} weight versions ({_schedule_str(lay)} stashes them)"
    if lay.zero == 0:
        grads = f"{w.grad} B/param, held from backward to the optimizer step"
    else:
        kind = "fp32" if train.grad_bytes == 4 else "bf16"
        if lay.zero == 1:
            grads = f"full {kind} buffer, reduce-scattered in place (its 1/dp range is the shard; ZeRO-1)"
        else:
            grads = f"{kind} shard, {dp}" + (", made by backward, freed by the update" if lay.num_microbatches == 1
                                                and lay.pp == 1 else "")
    if m.terms.get("gradients_at_once") and m.phase.startswith("end of backward"):
        grads += ("; at the peak a second copy: the whole model compiled hands every gradient over at once "
                  "(train.compile_scope=block: a block's at a time)")
    master = "fp32 master 4 B + " if w.master else ""
    opt = f"{master}{OPT_BYTES.get(train.optimizer, train.optimizer)}" + (f", {dp}" if lay.zero else "")
    if lay.offload != "none":
        opt += "; in pinned CPU memory"
    lines = [("parameters", m.params, m.at_peak.get("params", 0), params),
             ("gradients", m.grads, m.at_peak.get("grads", 0), grads),
             ("optimizer state", m.optimizer, m.at_peak.get("optimizer", 0), opt)]
    if not shape.is_bare:
        per = m.terms["saved_per_microbatch_first_stage"]
        inflight = m.terms["in_flight_microbatches"]
        why = {"none": "every block's saved tensors", "selective": "all but the attention core's logsumexp",
               "selective-ops": "GEMM and attention outputs, one input per block",
               "selective-ops-alternate": "every other GEMM's and the attention outputs, one input per block",
               "full": "one input per block", "sqrt": "one input per sqrt(L)-block segment",
               "every-k": f"one input per {lay.recompute_every}-block segment"}[lay.recompute]
        lines.append(("activations", m.activations, m.at_peak.get("activations", 0),
                      f"saved for backward ({why}): {per / GIB:.2f} GiB per micro-batch x {inflight:g} in flight"))
        lines.append(("temporary buffers", m.buffers, m.at_peak.get("buffers", 0), _buffer_note(m, lay)))
    elif m.buffers:
        lines.append(("temporary buffers", m.buffers, m.at_peak.get("buffers", 0), "gradient reduce buckets"))
    lines.append(("allowance", m.allowance, m.allowance,
                  f"CUDA context {gpu.context_gib:g} GiB + {gpu.fragmentation:.0%} fragmentation"))
    return lines


def _buffer_note(m, lay) -> str:
    parts = ["fp32 loss gradients (B*T x vocab)"]
    if m.terms.get("autocast_weight_copies"):
        parts.append("bf16 autocast weight copies")
    if m.terms.get("recompute_segment"):
        parts.append("one recomputed segment")
    if m.terms.get("engine_gathered"):
        parts.append("ZeRO-3 gathered blocks")
    if m.terms.get("engine_during") or m.terms.get("engine_pending"):
        parts.append("gradient reduce buffers")
    return ", ".join(parts)


def time_lines(shape: ModelShape, train: Training, gpu: GPU, c: Candidate) -> list[tuple[str, float, str]]:
    t, lay = c.time, c.layout
    d = shape.cfg.d_model if shape.cfg is not None else 0
    rate = gpu.sustained_flops(train.precision, d) / 1e12 if d else 0.0
    out = []
    if not shape.is_bare:
        replay = t.terms.get("recompute_flops", 0.0)
        out.append(("compute", t.compute_s, f"{t.model_flops_per_step / 1e12:,.1f} model TFLOP (PaLM 6N + 12LHQT)"
                    + (f" + {replay / 1e12:,.1f} recomputed" if replay else "") + f" at {rate:.0f} TFLOP/s "
                    f"({gpu.efficiency(train.precision, d):.0%} of the {train.precision} peak at width {d})"
                    + _fp8_part(train, gpu, rate, t.terms.get("fp8_flops", 0.0))))
        out.append(("eager ops", t.ops_s, f"launches and elementwise kernels, {gpu.op_overhead_s * 1e6:.1f} us per op"))
    if t.optimizer_s:
        out.append(("optimizer step", t.optimizer_s, _optimizer_why(train, gpu)))
    if t.comm_s:
        parts = ", ".join(f"{k[5:-2]} {v * 1e3:.1f} ms" for k, v in t.terms.items() if k.startswith("comm_") and v)
        for key, words in (("zero_gather", "ZeRO-3 gathers"), ("param_gather", "param all-gather"),
                           ("dp ", "gradient reduce "), ("tp ", "tensor-parallel "), ("pp ", "pipeline sends "),
                           ("ep ", "all-to-all "), ("cp ", "context-parallel "),
                           ("regather ", "SP inputs gathered again in backward ")):
            parts = parts.replace(key, words)
        out.append(("communication", t.comm_exposed_s, f"not hidden behind compute, of {t.comm_s * 1e3:.1f} ms ({parts})"))
    if t.bubble_s:
        share = t.bubble_s / (t.step_time_s - t.optimizer_s - t.offload_s)
        out.append(("pipeline bubble", t.bubble_s, f"{share:.1%} of the pipelined time idle in the simulated "
                    f"{_schedule_str(lay)}, m={lay.num_microbatches} "
                    f"({'the stages of its split' if lay.stage_layers else 'even stages'}, the head on the last)"))
    if t.terms.get("host_s"):
        busy = t.terms["gpu_s"]
        paced = "the step waits on it: host-paced" if t.host_paced else f"under the GPU's {busy * 1e3:.1f} ms: hidden"
        fp8 = t.terms.get("fp8_ops", 0.0)
        fp8 = (f" (memory.fp8's {fp8:,.0f} at {FP8_HOST_OP_SHARE * gpu.host_op_s * 1e6:.1f} us: torchao's float8 "
               "tensors)") if fp8 else ""
        out.append(("host issue", t.terms["host_s"], f"eager ops at {gpu.host_op_s * 1e6:.1f} us{fp8}, tp / ep "
                    "collectives at "
                    f"{gpu.host_collective_s * 1e3:.2f} ms each, data-parallel launches at {launch_s(gpu) * 1e3:.2f} ms; "
                    f"{paced}"))
    if t.offload_s:
        out.append(("offload", t.offload_s, f"PCIe at {gpu.pcie_gbps:g} GB/s, the CPU optimizer "
                    f"({gpu.host_adam_params_per_s / 1e9:g} G params/s) and the host's cast of the masters "
                    f"({gpu.host_cast_rate() / 1e9:g} G params/s)"))
    return out


def _optimizer_why(train: Training, gpu: GPU) -> str:
    """What the optimizer step is: an HBM sweep, by torch's fused kernel or teratrain's AdamW kernel
    (time.optimizer_s)."""
    if train.optimizer != "adamw" or train.torch_adamw:
        name = "AdamW" if train.optimizer == "adamw" else train.optimizer
        return f"fused {name} sweep at {gpu.hbm_gbps * gpu.mem_efficiency:.0f} GB/s"
    return "teratrain's AdamW kernel: an HBM sweep of the parameters, gradients and moments, a launch a group"


def _fp8_part(train: Training, gpu: GPU, rate: float, flops: float) -> str:
    """The compute line's float8 GEMMs: their FLOPs and rate (memory.fp8)."""
    if not flops:
        return ""
    speedup = getattr(gpu, f"fp8_speedup_{train.fp8}")
    return f"; {flops / 1e12:,.1f} TFLOP of it in float8 GEMMs ({train.fp8}) at {rate * speedup:.0f} TFLOP/s"


def _host_line(gpu: GPU, c: Candidate, host_mem: float | None) -> str:
    per = gpus_per_node(c.layout, gpu)
    node = f"offloaded state, not on the GPU; x {per} GPUs per node = {c.host_per_node(gpu) / GIB:,.1f} GiB"
    if host_mem is None:
        return node + " (host memory not checked)"
    return node + (f" of the host's {host_mem:,.4g} GiB" if c.host_fits
                   else f": exceeds the host's {host_mem:,.4g} GiB")


def render(shape, train, cfg, gpu, gpus, limits: tuple, best: Candidate, cands, top, advice, notes) -> str:
    gpu_mem, host_mem = limits
    lay, m, t = best.layout, best.memory, best.time
    n = shape.counts()["total"]
    active = f", {shape.counts()['active'] / 1e9:.3g} B active per token" if shape.num_experts > 1 else ""
    head = f"teratrain plan: {shape.name} ({n / 1e9:.3g} B params{active}) on {gpus} x {gpu.name.upper()} ({gpu_mem:g} GiB)"
    if not shape.is_bare:
        head += f", global batch {train.global_batch} x {shape.cfg.seq_len} tokens"
    fp8 = f" + fp8 {train.fp8}" if train.fp8 != "none" else ""
    out = [head + f", {train.precision}{fp8}, {train.optimizer}, {mode_of(train)}", "",
           f"Chosen layout: {_layout_str(lay)}  ({lay.num_microbatches} micro-batch(es) per step)", "",
           f"{'Memory per GPU':24}{'GiB':>8}{'at peak':>9}  what it is"]
    for name, held, peak, why in memory_lines(shape, train, gpu, best):
        out.append(f"  {name:22}{_gib(held)}{_gib(peak)}  {why}")
    out.append(f"  {'total':22}{'':8}{_gib(m.total)}  must fit {gpu_mem:g} GiB; the peak falls at: {m.phase}")
    if m.host:
        out.append(f"  {'host (pinned CPU)':22}{_gib(m.host)}{'':9}  {_host_line(gpu, best, host_mem)}")
    out += ["", f"{'Time per step':24}{'s':>8}"]
    for name, sec, why in time_lines(shape, train, gpu, best):
        out.append(f"  {name:22}{sec:8.4f}  {why}")
    out.append(f"  {'step time':22}{t.step_time_s:8.4f}" + (f"  {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}"
                                                            if not shape.is_bare else "  (no compute: bare count)"))
    out += ["", f"Top {min(top, len(cands))} layouts (fastest first, * = chosen; {sum(c.fits for c in cands)} of "
            f"{len(cands)} fit):", f"    {'dp':>4}{'tp':>4}{'pp':>4}{'ep':>4}{'zero':>5}{'mb':>4} {'recompute':14}"
            f"{'offload':10}{'GiB':>8}{'step s':>9}{'MFU':>7}" + ("  cp" if any(c.layout.cp > 1 for c in cands) else "")
            + ("  schedule (stage layers)" if any(c.layout.pp > 1 for c in cands) else "")]
    for c in [c for c in cands if c.fits][:top]:
        L = c.layout
        out.append(f"  {'*' if c is best else ' '} {L.dp:>4}{L.tp:>4}{L.pp:>4}{L.ep:>4}{L.zero:>5}{L.micro_batch:>4} "
                   f"{L.recompute:14}{L.offload:10}{c.memory.total / GIB:8.1f}{c.time.step_time_s:9.4f}"
                   + (f"{c.time.mfu:7.1%}" if not shape.is_bare else f"{'-':>7}")
                   + (f"  {L.cp} {L.cp_form}" if L.cp > 1 else "")
                   + (f"  {_schedule_str(L)}" + (f" ({split_str(L.stage_layers)})" if L.stage_layers else "")
                      if L.pp > 1 else ""))
    rejected = [c for c in cands if not c.fits]
    on_host = sum(not c.host_fits for c in rejected)
    if rejected:
        out.append(f"  ({len(rejected)} layouts exceed {gpu_mem:g} GiB" + (
            f" or the host's {host_mem:,.4g} GiB: {on_host} of them by their pinned host memory)" if on_host else ")"))
    if advice and advice.get("applied"):
        out += ["", f"Batch: optim.lr_scaling={advice['rule']} scales LR {advice['base_lr']:g} (tuned at global batch "
                f"{advice['base_batch']}) to {advice['lr']:.3g} at {advice['global_batch']} as it trains; keep optim.lr "
                f"as tuned. Suggested warmup: {advice['warmup_steps']} steps."]
    elif advice:
        out += ["", f"Batch advice: LR {advice['base_lr']:g} was tuned at global batch {advice['base_batch']}; at "
                f"{advice['global_batch']} use lr={advice['lr']:.3g} ({advice['rule']} rule; linear gives "
                f"{advice['lr_linear']:.3g}, sqrt {advice['lr_sqrt']:.3g}) with {advice['warmup_steps']} warmup steps."]
    out += [f"Note: {n}" for n in notes]
    return "\n".join(out)


def _layout_json(lay) -> dict:
    """The layout's fields, its schedule in the config's spelling (parallel.schedule)."""
    return {**lay.as_dict(), "schedule": config_name(lay.schedule)}


def as_json(shape, train, cfg, gpu, gpus, limits: tuple, best: Candidate, cands, top, advice, notes) -> dict:
    gpu_mem, host_mem = limits
    m, t = best.memory, best.time
    return {"model": shape.name, "num_params": shape.counts()["total"], "num_active_params": shape.counts()["active"],
            "gpus": gpus, "gpu": gpu.name, "gpu_mem_gib": gpu_mem, "host_mem_gib": host_mem,
            "host_per_node": best.host_per_node(gpu), "host_fits": best.host_fits,
            "precision": train.precision, "optimizer_name": train.optimizer, "mode": mode_of(train),
            "global_batch": train.global_batch, "seq_len": None if shape.is_bare else shape.cfg.seq_len,
            **{k: getattr(m, k) for k in ("params", "grads", "optimizer", "activations", "buffers", "allowance",
                                          "total", "peak_allocated", "host", "phase", "at_peak", "phases")},
            "step_time_s": None if shape.is_bare else t.step_time_s,
            "tokens_per_s": None if shape.is_bare else t.tokens_per_s,
            "mfu": None if shape.is_bare else t.mfu, "time": t.as_dict(), "layout": _layout_json(best.layout),
            "candidates": [{"layout": _layout_json(c.layout), "total": c.memory.total, "fits": c.fits,
                            "host": c.memory.host, "host_fits": c.host_fits,
                            "step_time_s": c.time.step_time_s, "mfu": c.time.mfu} for c in cands[:top]],
            "num_candidates": len(cands), "num_fitting": sum(c.fits for c in cands),
            "batch_advice": advice, "assumptions": {k: v for k, v in gpu.__dict__.items()}, "notes": notes}
