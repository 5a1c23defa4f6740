"""metrics.wandb: each metrics.jsonl record's numbers go to a W&B run (offline unless an API key is
configured), the config with them; the run id follows the run directory; no wandb package is one
sentence. The adapter is tested against a stand-in module recording its calls, and against wandb
itself in offline mode where it is installed."""

import sys
import types

import pytest

from teratrain.config import ConfigError
from teratrain.metrics import MetricsLog, check_sinks
from teratrain.wandb_sink import WandbSink, check, mode
from tests.helpers import make_config


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, numbers, step):
        self.logged.append((step, numbers))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []
    module.Settings = lambda **kw: kw

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


RECORDS = [{"step": 1, "loss": 8.3, "lr": 1e-3, "mfu": None, "model_state_bytes": {"params": 4}},
           {"step": 2, "loss": 8.1, "lr": 1e-3, "skipped_steps": 0,
            "checkpoints": [{"step": 2, "block_s": 0.01, "write_s": 0.5, "async": True}]}]


def test_records_go_to_the_run_with_the_config(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: offline
    cfg = make_config("metrics.wandb=true", "metrics.wandb_project=proj")
    log = MetricsLog(tmp_path, tensorboard=False, append=False, sinks=[WandbSink(tmp_path / "run-a", cfg, False)])
    assert fake_wandb.runs == []  # started at the first record, not before
    for r in RECORDS:
        log.write(r)
    log.close()
    (run,) = fake_wandb.runs
    assert run.init["project"] == "proj" and run.init["name"] == "run-a" and run.init["mode"] == "offline"
    assert run.init["dir"] == str(tmp_path / "run-a") and run.init["config"]["metrics"]["wandb"] is True
    assert run.logged == [(1, {"loss": 8.3, "lr": 1e-3}),
                          (2, {"loss": 8.1, "lr": 1e-3, "skipped_steps": 0, "checkpoint_block_s": 0.01,
                               "checkpoint_write_s": 0.5})]
    assert run.finished and (tmp_path / "metrics.jsonl").exists()


def test_a_resumed_run_continues_the_same_wandb_run(fake_wandb, tmp_path):
    cfg = make_config("metrics.wandb=true", "metrics.wandb_mode=offline")
    for resume in (False, True):
        WandbSink(tmp_path / "run", cfg, resume).log(RECORDS[0])
    first, again = fake_wandb.runs
    assert first.init["id"] == again.init["id"] and again.init["resume"] == "allow"
    WandbSink(tmp_path / "other", cfg, False).log(RECORDS[0])
    assert fake_wandb.runs[-1].init["id"] != first.init["id"]


def test_auto_is_online_only_with_an_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert mode("auto") == "offline" and mode("online") == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert mode("auto") == "online"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert mode("auto") == "online" and mode("offline") == "offline"


def test_without_the_package_it_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it now raises ImportError
    with pytest.raises(ConfigError, match="metrics.wandb needs the wandb package; install it with pip install wandb"):
        check(make_config("metrics.wandb=true"))
    check(make_config())  # off: nothing needed


def test_tensorboard_without_its_package_is_refused_before_the_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="metrics.tensorboard needs the tensorboard package; install it with pip "
                                          "install tensorboard, or set metrics.tensorboard=false"):
        check_sinks(make_config("metrics.tensorboard=true"))
    check_sinks(make_config())


def test_real_wandb_offline(tmp_path, monkeypatch):
    """Where wandb is installed: an offline run written under the run directory."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_config("metrics.wandb=true", "metrics.wandb_mode=offline")
    sink = WandbSink(tmp_path, cfg, False)
    for r in RECORDS:
        sink.log(r)
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
