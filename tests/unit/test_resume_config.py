"""`--resume`'s config (rundir.resume_config): the saved config.toml with the new keys on top, nested
tables key by key, and the layout keys that follow the launch dropped."""

from teratrain.config import load_config, read_toml
from teratrain.config_toml import to_toml
from teratrain.optim.lr import lr_at
from teratrain.rundir import changes, resume_config


def saved_run(tmp_path, *sets):
    tmp_path.mkdir(exist_ok=True)
    cfg = load_config(None, list(sets))
    cfg.parallel.dp = 2  # what train.run records
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    return tmp_path


def test_nested_override_keeps_the_rest_of_the_moe_table(tmp_path):
    run = saved_run(tmp_path, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.every=2")
    cfg = resume_config(run, None, ["model.moe.aux_loss_weight=0.02"])
    m = cfg.model.moe
    assert (m.num_experts, m.top_k, m.every, m.aux_loss_weight) == (4, 2, 2, 0.02)
    assert cfg.parallel.dp is None  # follows the processes launched
    assert changes(read_toml(run / "config.toml"), cfg) == ["model.moe.aux_loss_weight: 0.01 -> 0.02",
                                                            "parallel.dp: 2 -> None"]


def test_a_stage_split_is_dropped_when_the_pipeline_changes(tmp_path):
    run = saved_run(tmp_path, "model.n_layers=4", "parallel.pp=2", "parallel.stage_layers=[3, 1]")
    assert resume_config(run, None, []).parallel.stage_layers == [3, 1]
    assert resume_config(run, None, ["parallel.pp=1"]).parallel.stage_layers is None


def test_a_run_resumed_before_its_warmup_ended_does_not_drop_its_lr(tmp_path):
    """A 4-step run with 30 warmup steps, resumed to 60: pinning the schedule to 4 steps would take the
    lr from its peak to min_lr_ratio x peak in one step after the warmup. Its decay had not begun, so
    the schedule spans the new length: the warmup goes on, then the cosine decays smoothly."""
    run = saved_run(tmp_path, "optim.lr=1e-4", "optim.warmup_steps=30", "train.steps=4")
    cfg = resume_config(run, None, ["train.steps=60"])
    assert cfg.schedule_steps == 60
    lrs = [lr_at(s, 1e-4, 30, cfg.schedule_steps, "cosine", 0.1) for s in range(60)]
    assert max(lrs) == 1e-4 and max(a - b for a, b in zip(lrs, lrs[1:])) < 0.1 * 1e-4  # no step falls by 90%
    done = saved_run(tmp_path / "past", "optim.warmup_steps=2", "train.steps=4")  # decay begun: pinned
    assert resume_config(done, None, ["train.steps=8"]).schedule_steps == 4


def test_ranks_of_a_launch_take_the_launchers_resume_decision(tmp_path, monkeypatch):
    """checkpoint.resume=auto decides once, in the launcher of `teratrain train --nproc`: it may start the
    run over (clearing what auto looks at) before its ranks start, so a rank never decides again."""
    from teratrain import rundir

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    (tmp_path / "config.toml").write_text("")  # a run that stopped before its first checkpoint
    mode, resume, note, run_dir = rundir.decide_resume("auto", str(tmp_path), None, None)
    assert (mode, resume, run_dir) == ("auto", False, tmp_path) and "starting it over" in note
    said = "resume=auto: ... starting it over"
    assert rundir.decide_resume("auto", str(tmp_path), False, said) == (False, False, said, tmp_path)
    assert rundir.decide_resume("auto", str(tmp_path), True, None)[:2] == (True, True)


def test_a_bad_key_in_the_saved_config_names_the_file(tmp_path):
    import pytest

    from teratrain.config import ConfigError

    run = saved_run(tmp_path)
    toml = run / "config.toml"
    toml.write_text(toml.read_text().replace("n_layers = ", "n_layerz = "))
    with pytest.raises(ConfigError, match=r"config.toml \(the run's saved config\): unknown config key 'model.n_layerz'"):
        resume_config(run, None, [])


def test_an_auto_run_replanned_leaves_its_old_pick_unset(tmp_path):
    run = saved_run(tmp_path, "parallel.auto=true", "train.micro_batch=16", "parallel.zero=1", "optim.lr=0.01")
    cfg = resume_config(run, None, [], replan=True)
    assert "micro_batch" not in cfg.train.model_fields_set and "zero" not in cfg.parallel.model_fields_set
    assert cfg.optim.lr == 0.01  # what is not a layout key stays
