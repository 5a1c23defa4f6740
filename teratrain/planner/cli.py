"""`teratrain plan`: what fits, how fast, and why, before anything is launched.

    teratrain plan [CONFIG.toml|config.json] [--model PRESET | --params N] [--gpus N] [--gpu-mem GiB]
                   [--gpu h100|h200|a100] [--host-mem GiB] [--set KEY=VALUE ...] [--hw KEY=VALUE ...]
                   [--hw-file FILE] [--json] [--plot FILE] [--schedule-plot FILE] [--top K]

Degrees set in the config or with --set are kept; the others are searched (search.py). Bad input
and "nothing fits" exit 2 with one sentence (ConfigError, printed by teratrain.cli.main).
"""

from __future__ import annotations

import dataclasses
import json

from teratrain.config import ConfigError, load_config
from teratrain.fsio import PICTURES, output_file
from teratrain.parallel.ep_plan import check_ep
from teratrain.planner.hardware import (GPUS, HOST_GIB_PER_GPU, borrowed, gpu_with, host_memory_gib, hw_keys,
                                        local_gpu_count, read_hw_file)
from teratrain.planner import modes
from teratrain.planner.auto import KEYS, command_line, train_command
from teratrain.planner.inputs import PLAN_PRECISION, fixed_of, load, model_sets, shape_of, training_of
from teratrain.planner.layout import ModelShape
from teratrain.planner.memory import GIB
from teratrain.planner.report import as_json, render
from teratrain.planner.pipeline import splits_backward
from teratrain.planner.search import Candidate, batch_advice, evaluate, gpus_per_node, search, smallest_gpu_count
from teratrain.planner.states import PlanError


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict per-GPU memory and step time; pick the fastest layout that fits",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="TOML config, or a HF config.json (Llama, Mistral, Qwen2/3, Mixtral, "
                                             "Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-2)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model preset, e.g. llama-8b (shorthand for --set model.preset=...)")
    src.add_argument("--params", type=float, help="bare parameter count, e.g. 1.5e9: model states only")
    p.add_argument("--gpus", type=int, help="GPUs to plan for (default: the product of the degrees set, else 1)")
    p.add_argument("--gpu-mem", type=float, help="usable memory per GPU in GiB (default: the --gpu's)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset for peak FLOP/s and bandwidths (default: the "
                   "--hw-file's, else h100)")
    p.add_argument("--host-mem", type=float, help="host memory per node in GiB that offloaded (pinned) state must "
                   "fit, for all the node's GPUs together (default: this machine's when --gpus are its own, else "
                   f"{HOST_GIB_PER_GPU:g} GiB per GPU of a node)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.tp=2 (a key set here is not searched)")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a hardware assumption ({', '.join(hw_keys())})")
    p.add_argument("--hw-file", metavar="FILE", help="hardware terms measured on the machine: a "
                   "bench/planner_validate.py result (its collectives, PCIe and CPU optimizer speed) or a JSON "
                   "{key: number} object; --hw flags override it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE", help="write a stacked bar chart of memory per GPU (.png, .svg or .pdf)")
    p.add_argument("--schedule-plot", metavar="FILE", help="draw the chosen layout's pipeline step as simulated "
                   "(.png, .svg or .pdf; e.g. with --set parallel.pp=4 --set parallel.schedule=interleaved-1f1b)")
    p.add_argument("--top", type=int, default=5, help="layouts shown in the ranking (default 5)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    for flag, path in (("--plot", args.plot), ("--schedule-plot", args.schedule_plot)):
        if path:
            output_file(path, flag, PICTURES)
    cfg, shape, notes = _inputs(args)
    gpu = _gpu(args, notes)
    gpu_mem = args.gpu_mem if args.gpu_mem is not None else gpu.memory_gib
    if gpu_mem <= 0 or (args.gpus is not None and args.gpus < 1) or args.top < 1:
        raise ConfigError("--gpu-mem, --gpus and --top must be positive; pass e.g. --gpus 8 --gpu-mem 80.")
    fixed = fixed_of(cfg)
    gpus = args.gpus or _default_gpus(fixed)
    training_of(cfg, notes)  # its notes, once
    host_mem = _host_mem(args, notes, gpus, gpu.gpus_per_node)
    mode, train, cands = _search_modes(cfg, shape, (gpus, gpu, fixed, gpu_mem, host_mem), notes)
    fitting = [c for c in cands if c.fits]
    notes += _borrowed(gpu, shape, train, (fitting or cands)[0].layout)
    limits = (gpu_mem, host_mem)
    if not fitting:
        why = nothing_fits(shape, train, gpus, gpu, fixed, limits, cands)
        if args.json:  # the leanest layout, with "fits": false, for scripts; the sentence still goes to stderr
            least = min(cands, key=lambda c: c.memory.total)
            print(json.dumps({**as_json(shape, train, cfg, gpu, gpus, limits, least, cands, args.top, None, notes),
                              "fits": False, "error": why}))
        raise ConfigError(why)
    best = fitting[0]
    advice = _advice(cfg)
    if args.plot:
        from teratrain.planner.plot import plot_memory, what_if_base

        base = what_if_base(best.layout, train.global_batch)
        what_if = " (what if dp=8: one GPU has nothing to shard)" if base is not best.layout else ""
        plot_memory(args.plot, shape, train, base, gpu, gpu_mem, f"{_name(shape)} on {gpu.name.upper()}: memory per "
                    f"GPU, dp={base.dp} tp={base.tp} pp={base.pp}, micro-batch {base.micro_batch}{what_if}")
        notes.append(f"memory chart written to {args.plot}{what_if}")
    if args.schedule_plot:
        if shape.is_bare:
            raise ConfigError("--schedule-plot needs a model shape to time the stages; pass --model or a config "
                              "instead of --params.")
        from teratrain.planner.plot import plot_schedule

        p = cfg.parallel
        options = {"vertical_sync": True} if p.vertical_sync else {}
        if p.weight_version_every is not None:
            options["weight_version_every"] = p.weight_version_every
        notes.append(plot_schedule(args.schedule_plot, shape, train, best.layout, best.time, gpu, **options))
    if best.time.host_paced and not train.graphed:
        notes.append(HOST_PACED)
        notes += _split_note(shape, train, best, gpu, gpu_mem)
    if train.compiled and not train.graphed:
        notes.append(COMPILED)
    if best.layout.ep > 2 and train.graphed and not cfg.train.compile_overlap:
        notes.append(EXCHANGE_UNDER_EXPERTS)
    command = _train_command(args, cfg, shape, best, gpus, gpu, fixed, mode)
    if args.json:
        print(json.dumps({**as_json(shape, train, cfg, gpu, gpus, limits, best, cands, args.top, advice, notes),
                          "fits": True, "train_command": command}))
    else:
        print(render(shape, train, cfg, gpu, gpus, limits, best, cands, args.top, advice, notes))
        print(f"Train it: {command_line(command)}" if command else
              "Train it: a bare parameter count has no model to train; plan a preset or a config for the command.")
    return 0


def _search_modes(cfg, shape, job: tuple, notes: list[str]) -> tuple:
    """(the mode planned, its Training, the searched candidates): under parallel.auto=true the mode that
    parallel.auto would take (planner/modes.py), each allowed mode searched with its own layouts, said in `notes`;
    else the configured mode."""
    gpus, gpu, fixed, gpu_mem, host_mem = job
    allowed = modes.allowed(cfg, gpu.name) if cfg.parallel.auto else [modes.configured(cfg)]
    searched = {}
    for mode in allowed:
        if mode == modes.BLOCKS and modes.COMPILED in searched and not modes.blocks_may_help(searched[modes.COMPILED][1]):
            continue
        train = training_of(modes.with_mode(cfg, mode) if cfg.parallel.auto else cfg, [])  # notes: said once
        try:
            searched[mode] = (train, search(shape, train, gpus, gpu, fixed, gpu_mem, host_mem))
        except PlanError as e:
            raise ConfigError(str(e)) from None
    fastest = {m: next(c for c in cands if c.fits).time.step_time_s
               for m, (_, cands) in searched.items() if any(c.fits for c in cands) and not shape.is_bare}
    mode = modes.pick(fastest) if fastest else allowed[0]
    if cfg.parallel.auto and not shape.is_bare:
        notes.append("parallel.auto: " + modes.describe(mode, fastest, len(allowed)))
    return (mode, *searched[mode])


def _train_command(args, cfg, shape, best: Candidate, gpus: int, gpu, fixed: dict, mode: str) -> list[str] | None:
    """`teratrain train` with the plan's model, the user's settings and the chosen layout."""
    if shape.is_bare:
        return None
    toml = args.config if args.config and not args.config.endswith(".json") else None
    sets, _ = model_sets(args.config, args.model)
    sets += args.overrides
    if "precision" not in cfg.memory.model_fields_set:  # planned for bf16; the trainer's default is fp32
        sets.append(f"memory.precision={PLAN_PRECISION}")
    given = tuple(key for field, key in KEYS.items() if field in fixed)
    if cfg.parallel.auto:  # the mode planned (planner/modes.py), where not given
        sets += [f"{k}={str(v).lower()}" for k, v in modes.chosen_keys(cfg, mode).items()]
    return train_command(toml, sets, best.layout, gpus, gpu.gpus_per_node, given)


# Measured on 2 x H200 with bench/planner_validate.py, four runs: the same eager tensor- and
# expert-parallel layouts ran 1.1-1.7x apart between runs while the host's own speed moved 2x, where
# GPU-paced layouts (every pipeline) stayed within 2%.
HOST_PACED = ("the chosen layout's step is host-paced (the host takes longer to issue its kernels and "
              "collectives than the GPU to run them): it runs as fast as the host is at the moment, 1.1-1.7x apart "
              "between runs on shared hosts; train.compile=true with train.compile_mode=reduce-overhead replays the "
              "step as CUDA graphs and takes the host out")


def _split_note(shape: ModelShape, train, best: Candidate, gpu, gpu_mem: float) -> list[str]:
    """Where ZB-H1's split backward costs a host-paced step more than its bubble saves: the same layout
    under 1F1B, when the planner puts it faster."""
    if not splits_backward(best.layout):
        return []
    other = evaluate(shape, train, dataclasses.replace(best.layout, schedule="1f1b"), gpu, gpu_mem)
    if not other.fits or other.time.step_time_s >= best.time.step_time_s:
        return []
    slower = best.time.step_time_s / other.time.step_time_s - 1
    return [f"ZB-H1 plans {slower:.0%} slower than 1F1B at this layout: the host paces the step, and the split "
            "backward's host work (saved-tensor hooks, a graph walk, the weight rules) outweighs the bubble it "
            "fills (docs/pipeline.md, \"Schedules\"); parallel.schedule=1f1b runs it faster"]


# Measured with bench/moe.py --reorder (docs/moe.md, "Compiled and CUDA graphs"): graphed, 8 experts top-2 at the
# llama-1b width, ep=4 on 4 x H200 129.0 -> 124.1 ms a step, the exchange's exposed share 16.0% -> 11.3%;
# at ep=2 on 2 x H200 no change (121.2 and 121.3 ms), so the note starts above ep=2.
EXCHANGE_UNDER_EXPERTS = ("expert parallelism over more than 2 GPUs with CUDA graphs: train.compile_overlap=true "
                          "lets inductor launch each all-to-all early and wait for it late, under the experts' "
                          "GEMMs; at ep=4 on 4 x H200 (one run) it cut the exchange's exposed share of the step "
                          "from 16.0% to 11.3% and the step by 3.8% (the planner does not model this)")


# planner/time.py issued_ops, fused_s: fitted on one H200 row (llama-1b, 0.2137 s planned against 0.2134 s), held out
# at llama-8b's width (5% under); planner/compiled.py: the compiled peak, 36.9 GiB planned against 36.1 measured.
COMPILED = ("train.compile is planned with inductor's fused kernels (planner/time.py issued_ops, fused_s: within 1% on "
            "one H200 at llama-1b, 5% under at llama-8b's width) and what its partition keeps for backward "
            "(planner/compiled.py: 36.9 GiB planned against 36.1 GiB measured at llama-1b's shape, 28.5 against 28.2 "
            "for an 8-expert MoE); MoE at ep > 1 or other routers, tensor- or context-parallel, dropout, FP8 and "
            "recomputed blocks keep eager's count, which is more (recomputed: their loss compiled, a per-op "
            "policy's replay fused into the backward)")


def _host_mem(args, notes: list[str], gpus: int, gpus_per_node: int) -> float | None:
    """Host memory per node in GiB: --host-mem; else, planning for this machine's own GPUs, its memory;
    else (more GPUs than it has, or none here) HOST_GIB_PER_GPU per GPU of a node. Said in the notes
    unless given; None (not checked) where this machine's is unknown."""
    if args.host_mem is not None:
        if args.host_mem <= 0:
            raise ConfigError(f"--host-mem {args.host_mem:g} must be a positive size in GiB, e.g. --host-mem 2048.")
        return args.host_mem
    here = local_gpu_count()
    if gpus > here:
        per_node = HOST_GIB_PER_GPU * gpus_per_node
        notes.append(f"host memory: {per_node:,.0f} GiB per node assumed ({HOST_GIB_PER_GPU:g} GiB per GPU x "
                     f"{gpus_per_node} GPUs per node), as --gpus {gpus} is more than the {here} GPU(s) of this "
                     "machine; --host-mem gives the training machines' own")
        return per_node
    found = host_memory_gib()
    if found is None:
        notes.append("host memory unknown (no /proc/meminfo): offloaded state is not checked against it; give "
                     "--host-mem")
    else:
        notes.append(f"host memory: this machine's {found:,.1f} GiB (planning for its own GPUs; --host-mem plans "
                     "for another host)")
    return found


def _inputs(args) -> tuple:
    """(Config, ModelShape, notes) from the config file, --model, --params and --set."""
    if args.params is not None:
        if args.params < 1:
            raise ConfigError(f"--params {args.params:g} must be a positive parameter count, e.g. --params 1.5e9.")
        if args.config and args.config.endswith(".json"):
            raise ConfigError("--params replaces the model shape; pass either a config.json or --params, not both.")
        cfg = load_config(args.config, args.overrides)
        check_ep(cfg)
        return cfg, ModelShape(cfg=None, bare_params=int(args.params), name="bare parameter count"), []
    cfg, notes = load(args.config, args.model, args.overrides)
    check_ep(cfg)  # an expert-parallel degree the model cannot take, as `teratrain train` refuses it
    # a config file by its name; --model or none, by the preset and what --set changed of it
    name = args.config.rsplit("/", 1)[-1] if args.config and not args.model else ""
    return cfg, shape_of(cfg, name), notes


def _gpu(args, notes: list[str]):
    """The GPU preset with the --hw-file's terms, then the --hw flags, applied."""
    hw, preset = {}, None
    if args.hw_file:
        try:
            hw, preset = read_hw_file(args.hw_file)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        notes.append(f"hardware terms from {args.hw_file}: {', '.join(f'{k}={v:.4g}' for k, v in sorted(hw.items()))}")
    if preset is not None and preset not in GPUS:
        raise ConfigError(f"--hw-file {args.hw_file} names GPU preset {preset!r}; choose one of {', '.join(GPUS)} "
                          "with --gpu.")
    for item in args.hw:
        key, sep, val = item.partition("=")
        try:
            hw[key.strip()] = float(val) if key.strip() != "gpus_per_node" else int(val)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"--hw '{item}' is not KEY=NUMBER; write e.g. --hw inter_node_gbps=25.")
    try:
        return gpu_with(args.gpu or preset or "h100", hw)
    except KeyError as e:
        raise ConfigError(f"--hw {e.args[0]} is not a hardware assumption; use one of {', '.join(hw_keys())}.") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _borrowed(gpu, shape, train, lay) -> list[str]:
    """A note naming the constants the plan of `lay` reads that the card's preset holds from another card (not
    given with --hw or --hw-file)."""
    preset = GPUS.get(gpu.name)
    if preset is None:
        return []
    unused = {"fp8_speedup_tensorwise", "fp8_speedup_rowwise"} if train.fp8 == "none" else set()
    unused |= {"moe_efficiency", "grouped_half_work"} if shape.num_experts <= 1 else set()
    unused |= {"flops_efficiency_fp32"} if train.precision != "fp32" else set()
    unused |= {"host_adam_params_per_s"} if lay.offload == "none" else set()
    unused |= {"host_optimizer_tensor_s"} if not train.adamw_per_tensor else set()
    others = [k for k in borrowed(gpu.name) if k not in unused and getattr(gpu, k) == getattr(preset, k)]
    if not others:
        return []
    card, what = gpu.name.upper(), ("are another card's values" if len(others) > 1 else "is another card's value")
    return [f"the {card} preset's {', '.join(others)} {what}, not measured on an {card} "
            f"(planner/calibration/{gpu.name}.toml says whose); on one, `python bench/planner_validate.py --out "
            "r.json`, then the same with `--refit r.json --write`, measures those the step time fits"]


def _default_gpus(fixed: dict) -> int:
    n = 1
    for key in ("dp", "tp", "pp"):  # ep borrows data-parallel ranks
        n *= fixed.get(key, 1)
    return n


def _name(shape: ModelShape) -> str:
    return shape.name or "model"


def _advice(cfg) -> dict | None:
    o = cfg.optim
    rule = o.lr_scaling if o.lr_scaling != "none" else ("linear" if o.name == "sgd" else "sqrt")
    advice = batch_advice(o.lr, rule, o.base_batch, cfg.train.global_batch, o.warmup_steps)
    return advice and {**advice, "applied": o.lr_scaling != "none"}  # training scales optim.lr itself


def nothing_fits(shape, train, gpus, gpu, fixed, limits: tuple, cands: list[Candidate]) -> str:
    """One sentence: the least memory any layout needs (on the GPU, or on the host when every layout
    that fits the GPUs offloads more than the host holds), and the GPU count or change that fits."""
    gpu_mem, host_mem = limits
    on_gpu = [c for c in cands if c.memory.total <= gpu_mem * GIB]
    more = smallest_gpu_count(shape, train, gpus, gpu, fixed, gpu_mem, host_mem_gib=host_mem)
    fix = f"plan with --gpus {more}" if more else "use a smaller model or a larger --gpu-mem"
    kept = [k for k in ("zero", "recompute", "micro_batch", "offload", "tp", "pp") if k in fixed]
    if kept:
        fix += f", or unset {', '.join(kept)} so the planner may change {'it' if len(kept) == 1 else 'them'}"
    if on_gpu:  # they all offload more than the host holds
        least = min(on_gpu, key=lambda c: c.memory.host)
        per = gpus_per_node(least.layout, gpu)
        return (f"no layout of {_name(shape)} fits both {gpu_mem:g} GiB per GPU and {host_mem:,.4g} GiB of host "
                f"memory on {gpus} GPU(s): every layout that fits the GPUs offloads, and the leanest on the host "
                f"({_layout_words(least.layout)}) pins {per} x {least.memory.host / GIB:,.1f} = "
                f"{least.host_per_node(gpu) / GIB:,.1f} GiB per node; {fix}, or give --host-mem if the training "
                "machines have more.")
    least = min(cands, key=lambda c: c.memory.total)
    return (f"no layout of {_name(shape)} fits {gpu_mem:g} GiB per GPU on {gpus} GPU(s): the leanest "
            f"({_layout_words(least.layout)}) needs {least.memory.total / GIB:.1f} GiB; {fix}.")


def _layout_words(lay) -> str:
    return (f"dp={lay.dp} tp={lay.tp} pp={lay.pp} zero={lay.zero} recompute={lay.recompute} offload={lay.offload} "
            f"micro_batch={lay.micro_batch}" + (f" cp={lay.cp} cp_form={lay.cp_form}" if lay.cp > 1 else ""))
