"""parallel.auto: the keys a user left unset come from the planner's pick for the job (on GPUs the
fastest fitting layout, on CPU the stated rule), given keys are kept, layouts the engines refuse are
passed over, and `teratrain plan` prints a `teratrain train` command that reproduces its pick."""

from dataclasses import replace

import pytest

from teratrain.cli import build_parser
from teratrain.config import ConfigError, load_config
from teratrain.planner.auto import CPU_FIXED, KEYS, Target, _runnable, resolve
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import fixed_of, layout_of, shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.search import search
from tests.unit.test_planner_cli import plan_json

H100 = GPUS["h100"]
LLAMA = ["model.preset=llama-1b", "model.n_layers=4", "memory.precision=bf16", "parallel.auto=true",
         "train.global_batch=16"]


def _field(key: str) -> str:
    return next(f for f, k in KEYS.items() if k == key)


def test_gpu_job_takes_the_planners_fastest_fitting_layout_and_keeps_given_keys():
    cfg = load_config(None, LLAMA + ["parallel.zero=1", "train.compile=false"])  # the mode: test_planner_modes.py
    expected = next(c for c in search(shape_of(cfg), training_of(cfg), 4, H100, fixed_of(cfg), 79.2, 2048) if c.fits)
    choice = resolve(cfg, 4, Target(H100, 79.2, 2048, 4))
    assert choice.kept == ["parallel.zero", "train.compile"] and cfg.parallel.zero == 1
    assert set(choice.chosen) == set(KEYS.values()) - {"parallel.zero"}
    assert {k: getattr(expected.layout, _field(k)) for k in choice.chosen} == choice.chosen
    assert layout_of(cfg, 4).as_dict() == expected.layout.as_dict()
    assert "s per step" in choice.note and "GiB per GPU" not in choice.note  # memory: the summary's own line
    assert "kept as given: parallel.zero" in choice.note
    assert resolve(cfg, 4, Target(H100, 79.2, 2048, 4)).chosen == {}  # a resolved config has nothing left to choose


def test_cpu_job_follows_the_stated_rule():
    """Plain data parallelism; among what fits the host per process: lowest ZeRO stage, least
    recomputation, largest micro-batch."""
    sets = ["model.preset=tiny", "parallel.auto=true", "train.global_batch=16"]
    cfg = load_config(None, sets)
    choice = resolve(cfg, 2, Target(None, 8.0, None, 2))
    assert choice.chosen == {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "parallel.ep": 1, "parallel.zero": 0,
                             "parallel.offload": "none", "train.micro_batch": 8, "memory.recompute": "none"}
    assert "CPU host" in choice.note and "kept as given" not in choice.note  # the CPU's limits are not the user's
    # a host too small for the whole micro-batch: the largest one that fits without recomputation
    small = load_config(None, sets + ["model.preset=gpt2-124m"])
    no_context = replace(H100, context_gib=0.0)  # no CUDA context on a CPU host
    cands = search(shape_of(small), training_of(small), 2, no_context, dict(CPU_FIXED), 7.2, None, "cpu")
    fits = [c.layout for c in cands if c.fits and (c.layout.zero, c.layout.recompute) == (0, "none")]
    got = resolve(small, 2, Target(None, 7.2, None, 2)).chosen
    assert (got["parallel.zero"], got["memory.recompute"]) == (0, "none")
    assert got["train.micro_batch"] == max(lay.micro_batch for lay in fits) < 8


def test_layouts_the_engines_refuse_are_passed_over_and_other_sync_modes_are_refused():
    moe = load_config(None, ["model.preset=moe-tiny", "parallel.auto=true"])
    pooled = load_config(None, ["model.preset=moe-tiny", "parallel.auto=true", "model.moe.aux_loss_convention=transformers"])
    assert _runnable(moe, Layout(pp=2, dp=1, micro_batch=16, num_microbatches=2))
    assert not _runnable(pooled, Layout(pp=2, dp=1, micro_batch=16, num_microbatches=2))  # one loss over all stages
    assert _runnable(moe, Layout(dp=2, ep=2, micro_batch=16))
    with pytest.raises(ConfigError, match="parallel.auto plans all-reduce"):
        resolve(load_config(None, ["parallel.auto=true", "parallel.sync=local-sgd"]), 2, Target(H100, 79.2, None, 2))
    lean = ["model.preset=gpt2-124m", "parallel.auto=true", "memory.recompute=full"]
    with pytest.raises(ConfigError, match=r"no layout of gpt2-124m fits the 1.0 GiB of each GPU .* unset memory.rec"):
        resolve(load_config(None, lean), 1, Target(H100, 1.0, 64, 1))


def test_plan_prints_a_train_command_that_reproduces_its_pick(capsys, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "gpt2-124m"\n[train]\nglobal_batch = 16\n')
    d = plan_json(capsys, str(toml), "--gpus", "4", "--set", "parallel.zero=2")
    argv = d["train_command"]
    assert argv[:4] == ["teratrain", "train", "--nproc", "4"]
    args = build_parser().parse_args(argv[1:])
    cfg = load_config(args.config, args.overrides)
    assert cfg.memory.precision == "bf16" and cfg.parallel.zero == 2 and args.nproc == 4
    assert {k: v for k, v in layout_of(cfg, 4).as_dict().items() if k != "schedule"} == \
        {k: v for k, v in d["layout"].items() if k != "schedule"}
    assert argv.count("parallel.zero=2") == 1  # a given key is passed once, as given
    piped = plan_json(capsys, "--model", "gpt2-124m", "--gpus", "2", "--set", "parallel.pp=2", "--set",
                      "parallel.schedule=zb-h1")["train_command"]
    assert sum(a.startswith("parallel.schedule=") for a in piped) == 1


def test_a_split_with_an_empty_end_is_handed_over_even_where_the_run_profiles_its_split():
    """No profiled split leaves a stage without blocks, so a pick whose first or last stage runs the embedding
    or the head alone names its split under parallel.partition=profiled too; other splits only by count."""
    from teratrain.planner.auto import _keys

    ends = Layout(pp=2, virtual_stages=2, schedule="interleaved_1f1b", stage_layers=(0, 2, 2, 0))
    uneven = ends.with_(stage_layers=(1, 2, 2, 1))
    assert "stage_layers" in _keys(ends, "profiled") and "stage_layers" in _keys(uneven, "layers")
    assert "stage_layers" not in _keys(uneven, "profiled")
