"""`--resume`'s config (rundir.resume_config): the saved config.toml with the new keys on top, nested
tables key by key, and the layout keys that follow the launch dropped."""

from teratrain.config import load_config, read_toml
from teratrain.config_toml import to_toml
from teratrain.rundir import changes, resume_config


def saved_run(tmp_path, *sets):
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
