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


E, C, B, G = modes.EAGER, modes.COMPILED, modes.BLOCKS, modes.GRAPHS


@pytest.mark.parametrize("sets, allowed", [
    ([], [E, C, B, G]),
    (["train.compile=false"], [E]),
    (["train.compile=true"], [C, B, G]),
    (["train.compile_mode=default"], [E, C, B]),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], [G]),
    (["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"], [C, B]),
    (["train.compile=true", "train.compile_overlap=true"], [C, B, G]),
    (["train.compile=true", "train.compile_scope=block"], [B]),
    (["train.compile=true", "train.compile_scope=model"], [C, G]),
    (["train.compile=true", "train.compile_scope=auto"], [C, G]),
    (["memory.compress_activations=int8"], [E]),
    (["model.preset=moe-tiny"], [E, C, B, G]),  # bf16 on an H100: grouped GEMM
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


def test_block_by_block_is_taken_where_the_gradients_at_once_keep_the_whole_graph_out():
    """llama-1b, 4 micro-batches of 2 a step on one GPU: the whole model in one graph holds its fp32 gradients
    twice at the end of each later backward (planner/compiled.py gradients_at_once), each block in its own graph
    does not. With memory between the two layouts' needs, the whole graph must recompute and block by block
    need not: with recomputation kept off, parallel.auto takes block by block and writes train.compile_scope=block,
    which the trainer runs. Free to choose, it keeps the whole graph and selective-ops, whose replay inductor
    fuses into the backward (planned as fast as none: one H100 measured 138.0 ms a step both)."""
    from teratrain.planner.layout import Layout
    from teratrain.planner.search import evaluate

    sets = ["model.preset=llama-1b", "memory.precision=bf16", "parallel.auto=true", "train.global_batch=8",
            "train.micro_batch=2"]
    cfg = load_config(None, sets)
    lay = Layout(micro_batch=2, num_microbatches=4)
    need = {mode: evaluate(shape_of(cfg), training_of(modes.with_mode(cfg, mode)), lay, H100).memory.total / 2**30
            for mode in (modes.COMPILED, modes.BLOCKS)}
    assert need[modes.BLOCKS] < need[modes.COMPILED]
    between = Target(H100, (need[modes.BLOCKS] + need[modes.COMPILED]) / 2, 2048, 8)
    free = resolve(load_config(None, sets), 1, between).chosen
    assert free["memory.recompute"] == "selective-ops" and "train.compile_scope" not in free
    cfg = load_config(None, sets + ["memory.recompute=none"])
    choice = resolve(cfg, 1, between)
    assert choice.chosen["train.compile_scope"] == "block" and cfg.memory.recompute == "none"
    assert "mode: compiled block by block (train.compile=true, train.compile_mode=default, train.compile_scope=block)" \
        in choice.note
    assert cfg.train.compile_scope == "block"  # written into the config the trainer runs
    roomy = load_config(None, sets)
    assert "train.compile_scope" not in resolve(roomy, 1, Target(H100, need[modes.COMPILED] + 1, 2048, 8)).chosen
