"""launch.stop_on_signals: the first SIGTERM raises Stopped, and none raises once the command is
already ending (a launcher's SIGTERM arriving while a rank writes the report of its own error made
that report a traceback; seen in CI as a flaky test_a_rank_killed_without_a_word_is_named)."""

import os
import signal

import pytest

from teratrain.launch import Stopped, stop_on_signals


def test_first_signal_raises_stopped():
    with pytest.raises(Stopped):
        with stop_on_signals() as state:
            os.kill(os.getpid(), signal.SIGTERM)
    assert state["signum"] == signal.SIGTERM


def test_no_signal_raises_once_the_command_is_ending():
    with stop_on_signals() as state:
        state["ending"] = True
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # give the handler its chance to run between bytecodes
            pass
    assert state["signum"] is None
