"""parallel.auto's execution mode (planner/modes.py): only modes the config allows, each planned with its own
fastest fitting layout, a faster one taken over a simpler one only beyond modes.FASTER; shown by the start-up
note and by `teratrain plan`."""

import pytest

from teratrain.config import load_config
from teratrain.planner import modes
from teratrain.planner.auto import Target, resolve
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import fixed_of, shape_of, training_of
from teratrain.planner.search import search
from tests.unit.test_planner_cli import plan_json

H100 = GPUS["h100"]
LLAMA = ["model.preset=llama-1b", "model.n_layers=4", "memory.precision=bf16", "parallel.auto=true",
         "train.global_batch=16"]
JOB = Target(H100, 79.2, 2048, 4)


def _fastest_s(cfg, mode: str) -> float:
    run = modes.with_mode(cfg, mode)
    cands = search(shape_of(run), training_of(run), 4, H100, fixed_of(run), 79.2, 2048)
    return next(c for c in cands if c.fits).time.step_time_s


@pytest.mark.parametrize("sets, allowed", [
    ([], [modes.EAGER, modes.COMPILED, modes.GRAPHS]),
    (["train.compile=false"], [modes.EAGER]),
    (["train.compile=true"], [modes.COMPILED, modes.GRAPHS]),
    (["train.compile_mode=default"], [modes.EAGER, modes.COMPILED]),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], [modes.GRAPHS]),
    (["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"], [modes.COMPILED]),
    (["train.compile=true", "train.compile_overlap=true"], [modes.COMPILED, modes.GRAPHS]),
    (["memory.compress_activations=int8"], [modes.EAGER]),
    (["model.preset=moe-tiny"], [modes.EAGER, modes.COMPILED, modes.GRAPHS]),  # bf16 on an H100: grouped GEMM
])
def test_a_mode_the_user_turned_off_is_never_chosen(sets, allowed):
    cfg = load_config(None, LLAMA + sets)
    assert modes.allowed(cfg, "h100") == allowed
    assert modes.allowed(cfg, None) == [modes.configured(cfg)]  # CPU: the configured mode stays


def test_cuda_graphs_hold_experts_only_on_sm90_in_bf16():
    moe = ["model.preset=moe-tiny", "parallel.auto=true"]
    assert modes.GRAPHS not in modes.allowed(load_config(None, moe + ["memory.precision=bf16"]), "a100")
    assert modes.GRAPHS not in modes.allowed(load_config(None, moe + ["memory.precision=fp16"]), "h100")


def test_a_faster_mode_replaces_a_simpler_one_only_beyond_the_margin():
    e, c, g = modes.EAGER, modes.COMPILED, modes.GRAPHS
    assert modes.pick({e: 1.0, c: 1 - modes.FASTER / 2}) == e
    assert modes.pick({e: 1.0, c: 0.9, g: 0.9 * (1 - modes.FASTER / 2)}) == c
    assert modes.pick({e: 1.0, c: 0.9, g: 0.8}) == g
    assert modes.pick({c: 0.9, g: 0.95}) == c


def test_auto_takes_the_fastest_allowed_mode_and_says_so():
    """llama-1b width, 4 blocks, 4 x H100: compiled plans faster than eager and than CUDA graphs (whose best
    layout cannot use ZeRO-3); the keys written, the note names the mode and by how much."""
    cfg = load_config(None, LLAMA)
    planned = {m: _fastest_s(cfg, m) for m in modes.allowed(cfg, "h100")}
    choice = resolve(cfg, 4, JOB)
    mode = modes.pick(planned)
    assert mode == modes.COMPILED and choice.chosen["train.compile"] is True and cfg.train.compile
    assert choice.chosen["train.compile_mode"] == "default"  # pinned: a --resume plans no other mode
    assert f"mode: compiled (train.compile=true, train.compile_mode=default), planned {planned[modes.EAGER] / planned[mode] - 1:.0%} faster " \
           "than eager" in choice.note
    assert resolve(cfg, 4, JOB).chosen == {}  # the resolved config gives the mode too


def test_a_given_mode_is_kept():
    cfg = load_config(None, LLAMA + ["train.compile=false"])
    choice = resolve(cfg, 4, JOB)
    assert not cfg.train.compile and "train.compile" not in choice.chosen
    assert "mode: eager (train.compile=false), the one mode the config allows here" in choice.note
    assert "kept as given: train.compile" in choice.note


def test_host_paced_small_model_takes_cuda_graphs():
    """The tiny preset issues far longer than its GPU work: CUDA graphs take the host out."""
    cfg = load_config(None, ["model.preset=tiny", "parallel.auto=true", "train.global_batch=16", "memory.precision=bf16"])
    choice = resolve(cfg, 4, JOB)
    assert choice.chosen["train.compile_mode"] == "reduce-overhead" and cfg.train.cuda_graphs
    assert "mode: CUDA graphs" in choice.note


def test_plan_shows_the_mode_and_its_command_runs_it(capsys):
    d = plan_json(capsys, "--model", "llama-1b", "--gpus", "4", "--set", "parallel.auto=true")
    assert d["mode"] == modes.COMPILED
    assert any(n.startswith("parallel.auto: mode: compiled (train.compile=true, train.compile_mode=default), planned")
               for n in d["notes"])
    assert {"train.compile=true", "train.compile_mode=default"} <= set(d["train_command"])
    plain = plan_json(capsys, "--model", "llama-1b", "--gpus", "4")
    assert plain["mode"] == modes.EAGER and not any(n.startswith("parallel.auto") for n in plain["notes"])
