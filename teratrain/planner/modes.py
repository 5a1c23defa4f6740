"""Which execution mode `parallel.auto` (and `teratrain plan` of such a config) runs: eager, compiled
(train.compile=true), compiled block by block (and train.compile_scope=block) or CUDA graphs
(train.compile=true, train.compile_mode=reduce-overhead).

The rule, stated in docs/planner.md:
- a mode key the user gave is kept: train.compile=false allows eager only, train.compile=true the
  compiled modes, train.compile_mode=reduce-overhead CUDA graphs only among them, another compile_mode the
  plain compiled modes only (with that compile_mode), a given train.compile_scope the one compiled mode
  that it names; train.compile_overlap=true needs a compiled mode; memory.compress_activations (saved-tensor
  hooks that dynamo does not trace) allows eager only;
- compiled block by block plans as compiled but where the whole model would be one graph, whose backward
  hands every gradient over at once (planner/compiled.py gradients_at_once): it is taken where that
  second copy of the gradients keeps a faster layout from fitting;
- CUDA graphs hold an MoE layer only with torch's grouped GEMM, in bf16 on an sm90 GPU (H100, H200:
  parallelize.check_graphed_experts), so they are not tried for MoE models elsewhere;
- on CPU, where the planner's GPU time model means nothing, the configured mode stays;
- among the allowed modes, each with its own fastest fitting layout, a mode is taken over a simpler one
  (eager, then compiled, then block by block, then CUDA graphs) only where it plans more than FASTER
  faster: compiling costs minutes at start, the whole model in one graph ran 1-2% faster than block by
  block on one H200 (docs/memory.md), and the memory pools of CUDA graphs are not modelled (planner/memory.py).
"""

from __future__ import annotations

from teratrain.config_schema import Config
from teratrain.planner.layout import Training

EAGER, COMPILED, BLOCKS, GRAPHS = "eager", "compiled", "compiled block by block", "CUDA graphs"
ORDER = (EAGER, COMPILED, BLOCKS, GRAPHS)  # simpler first
# The keys each mode writes where the user gave none (a given one already holds the mode's value: `allowed`), so
# that the run's config.toml pins the mode (a --resume plans no other); "compiled" keeps a given compile_mode
# (max-autotune-no-cudagraphs).
SETS = {EAGER: {"train.compile": False}, COMPILED: {"train.compile": True, "train.compile_mode": "default"},
        BLOCKS: {"train.compile": True, "train.compile_mode": "default", "train.compile_scope": "block"},
        GRAPHS: {"train.compile": True, "train.compile_mode": "reduce-overhead"}}
KEYS = ("train.compile", "train.compile_mode", "train.compile_scope")
SCOPES = {COMPILED: ("auto", "model"), BLOCKS: ("block",)}  # the train.compile_scope each compiled mode runs
FASTER = 0.01  # below the planner's own error on its validated rows: not worth a change of mode
GROUPED_MM_GPUS = ("h100", "h200")  # sm90: torch's grouped GEMM reads no row offsets back to the host


def _mode(graphed: bool, compiled: bool, scope: str) -> str:
    if graphed:
        return GRAPHS
    if not compiled:
        return EAGER
    return BLOCKS if scope == "block" else COMPILED


def mode_of(train: Training) -> str:
    return _mode(train.graphed, train.compiled, train.compile_scope)


def configured(cfg: Config) -> str:
    return _mode(cfg.train.cuda_graphs, cfg.train.compile, cfg.train.compile_scope)


def allowed(cfg: Config, gpu_name: str | None) -> list[str]:
    """The modes `cfg` allows on a GPU of preset `gpu_name` (None: CPU), simpler first (module docstring)."""
    t, given = cfg.train, cfg.train.model_fields_set
    if gpu_name is None:
        return [configured(cfg)]
    if cfg.memory.compress_activations != "none":
        return [EAGER]
    out = []
    if not ("compile" in given and t.compile) and not t.compile_overlap:
        out.append(EAGER)
    if "compile" in given and not t.compile:
        return out
    mode_given, scope_given = "compile_mode" in given, "compile_scope" in given
    if not mode_given or t.compile_mode != "reduce-overhead":
        out += [mode for mode in (COMPILED, BLOCKS) if not scope_given or t.compile_scope in SCOPES[mode]]
    if t.compile_scope == "block":  # CUDA graphs record the whole step (config_schema.compile_scope_problem)
        return out
    graphed_experts = cfg.memory.precision == "bf16" and gpu_name in GROUPED_MM_GPUS
    if (not mode_given or t.compile_mode == "reduce-overhead") and (not cfg.model.moe.enabled or graphed_experts):
        out.append(GRAPHS)
    return out


def blocks_may_help(cands) -> bool:
    """Whether compiled block by block can plan faster than compiled, read off the compiled mode's candidates
    (or the PlanError its search ended in): only where its fastest layout does not fit and holds gradients
    handed over at once (its plan's `gradients_at_once` term). Elsewhere it is not searched."""
    if not isinstance(cands, list) or not cands:
        return False
    fastest = min(cands, key=lambda c: c.time.step_time_s)
    return not fastest.fits and fastest.memory.terms.get("gradients_at_once", 0) > 0


def with_mode(cfg: Config, mode: str) -> Config:
    """A copy of `cfg` that runs in `mode`."""
    out = cfg.model_copy(deep=True)
    apply(out, chosen_keys(cfg, mode))
    return out


def apply(cfg: Config, values: dict[str, object]) -> None:
    """Set config keys ("section.name": value) in place."""
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def chosen_keys(cfg: Config, mode: str) -> dict[str, object]:
    """The mode keys to write for `mode`: those the user did not give."""
    return {k: v for k, v in SETS[mode].items() if k.split(".")[1] not in cfg.train.model_fields_set}


def pick(step_s: dict[str, float]) -> str:
    """The mode taken among those planned ({mode: its fastest fitting layout's step time}): a mode replaces a
    simpler one only where it plans more than FASTER faster."""
    best = None
    for mode in [m for m in ORDER if m in step_s]:
        if best is None or step_s[mode] < step_s[best] * (1 - FASTER):
            best = mode
    return best


def describe(mode: str, step_s: dict[str, float], allowed: int) -> str:
    """What `pick` took and why, e.g. `mode: compiled (train.compile=true), planned 19% faster than eager`;
    `allowed`: how many modes the config allowed."""
    keys = ", ".join(f"{k}={str(v).lower()}" for k, v in SETS[mode].items() if v is not False or mode == EAGER)
    if allowed == 1:
        return f"mode: {mode} ({keys}), the one mode the config allows here"
    slower = [f"{step_s[m] / step_s[mode] - 1:.0%} faster than {m}" for m in ORDER
              if m in step_s and step_s[m] > step_s[mode]]
    close = [m for m in ORDER if m in step_s and m != mode and step_s[m] <= step_s[mode]]
    why = [f"planned {' and '.join(slower)}"] if slower else []
    why += [f"{' and '.join(close)} planned less than {FASTER:.0%} faster, not worth the change"] if close else []
    return f"mode: {mode} ({keys}), " + ("; ".join(why) or "the only allowed mode with a layout that fits")
