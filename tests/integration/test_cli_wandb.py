"""`teratrain train --set metrics.wandb=true` logs every step's record to a W&B run (a stand-in module
recording the calls: the adapter itself is tested in tests/unit/test_metrics_wandb.py)."""

import sys
import types

from tests.integration.runner import metrics


class Run:
    def __init__(self, **init):
        self.init, self.steps, self.finished = init, [], False

    def log(self, numbers, step):
        self.steps.append(step)

    def finish(self):
        self.finished = True


def test_every_step_reaches_the_wandb_run(cli, tmp_path, monkeypatch):
    runs = []
    module = types.ModuleType("wandb")
    module.Settings = dict
    module.init = lambda **kw: runs.append(Run(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    cli.train(tmp_path / "run", "metrics.wandb=true", "metrics.wandb_mode=offline", "train.eval_batches=0",
              steps=3, in_process=True)
    (run,) = runs
    assert run.init["mode"] == "offline" and run.init["dir"] == str(tmp_path / "run")
    assert run.steps == [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3] and run.finished
