"""Which execution mode `parallel.auto` (and `teratrain plan` of such a config) runs: eager, compiled
(train.compile=true) or CUDA graphs (train.compile=true, train.compile_mode=reduce-overhead).

The rule, stated in docs/planner.md:
- a mode key the user gave is kept: train.compile=false allows eager only, train.compile=true the two
  compiled modes, train.compile_mode=reduce-overhead CUDA graphs only among them, another compile_mode the
  plain compiled mode only (with that compile_mode); train.compile_overlap=true needs a compiled mode;
  memory.compress_activations (saved-tensor hooks that dynamo does not trace) allows eager only;
- CUDA graphs hold an MoE layer only with torch's grouped GEMM, in bf16 on an sm90 GPU (H100, H200:
  parallelize.check_graphed_experts), so they are not tried for MoE models elsewhere;
- on CPU, where the planner's GPU time model means nothing, the configured mode stays;
- among the allowed modes, each with its own fastest fitting layout, a mode is taken over a simpler one
  (eager, then compiled, then CUDA graphs) only where it plans more than FASTER faster: compiling costs
  minutes at start, and the memory pools of CUDA graphs are not modelled (planner/memory.py).
"""

from __future__ import annotations

from teratrain.config_schema import Config
from teratrain.planner.layout import Training

EAGER, COMPILED, GRAPHS = "eager", "compiled", "CUDA graphs"
ORDER = (EAGER, COMPILED, GRAPHS)  # simpler first
# The keys each mode writes where the user gave none (a given one already holds the mode's value: `allowed`), so
# that the run's config.toml pins the mode (a --resume plans no other); "compiled" keeps a given compile_mode
# (max-autotune-no-cudagraphs).
SETS = {EAGER: {"train.compile": False}, COMPILED: {"train.compile": True, "train.compile_mode": "default"},
        GRAPHS: {"train.compile": True, "train.compile_mode": "reduce-overhead"}}
KEYS = ("train.compile", "train.compile_mode")
FASTER = 0.01  # below the planner's own error on its validated rows: not worth a change of mode
GROUPED_MM_GPUS = ("h100", "h200")  # sm90: torch's grouped GEMM reads no row offsets back to the host


def mode_of(train: Training) -> str:
    return GRAPHS if train.graphed else COMPILED if train.compiled else EAGER


def configured(cfg: Config) -> str:
    t = cfg.train
    return GRAPHS if t.cuda_graphs else COMPILED if t.compile else EAGER


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
    mode_given = "compile_mode" in given
    if not mode_given or t.compile_mode != "reduce-overhead":
        out.append(COMPILED)
    graphed_experts = cfg.memory.precision == "bf16" and gpu_name in GROUPED_MM_GPUS
    if (not mode_given or t.compile_mode == "reduce-overhead") and (not cfg.model.moe.enabled or graphed_experts):
        out.append(GRAPHS)
    return out


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
