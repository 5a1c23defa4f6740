"""When a run saves: by default every checkpoint.every_minutes of training (a run stopped before its
end then loses at most that), or every checkpoint.every steps; the ranks decide together."""

import time

from teratrain.config_toml import describe
from teratrain.mesh import Runtime
from teratrain.train import _stop_or_save
from tests.helpers import make_config

RT = Runtime.single("cpu")
NO_STOP = {"signum": None}


def test_default_is_by_time_and_print_config_says_its_unit():
    cfg = make_config()
    assert cfg.checkpoint.every is None and cfg.checkpoint.every_minutes == 10
    text = describe(cfg)
    assert "every_minutes = 10" in text and "minutes of training between checkpoints" in text
    now = time.monotonic()
    assert _stop_or_save(NO_STOP, now, cfg, RT, 1) == (0, False)
    assert _stop_or_save(NO_STOP, now - 601, cfg, RT, 2) == (0, True)  # ten minutes since the last save


def test_every_n_steps_still_works_and_replaces_the_clock():
    cfg = make_config("checkpoint.every=5")
    long_ago = time.monotonic() - 3600
    assert [_stop_or_save(NO_STOP, long_ago, cfg, RT, d)[1] for d in range(1, 11)] == [False] * 4 + [True] + \
        [False] * 4 + [True]
    assert _stop_or_save({"signum": 15}, time.monotonic(), make_config("checkpoint.every=0"), RT, 3) == (15, False)


def test_an_asynchronous_parameter_server_never_agrees_by_time():
    """Its workers run steps apart: a per-step agreement would hold them in lockstep."""
    cfg = make_config("parallel.sync=param-server")  # staleness unset: asynchronous
    assert _stop_or_save({"signum": 15}, time.monotonic() - 3600, cfg, RT, 3) == (0, False)
    assert _stop_or_save(NO_STOP, 0.0, make_config("parallel.sync=param-server", "checkpoint.every=3"), RT, 3)[1]
