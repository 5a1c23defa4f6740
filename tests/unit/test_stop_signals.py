"""launch.stop_on_signals: the first SIGTERM raises Stopped, and none raises once the command is
already ending (a launcher's SIGTERM arriving while a rank writes the report of its own error made
that report a traceback; seen in CI as a flaky test_a_rank_killed_without_a_word_is_named); in the
training loop a signal waits for the step's end, a second one does not, and the stop is bounded."""

import os
import signal
import subprocess
import sys
import time

import pytest

from teratrain.launch import Stopped, stop_after_step, stop_on_signals


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


def _let_handlers_run():
    for _ in range(1000):
        pass


def test_during_training_a_signal_is_recorded_and_a_second_one_stops_at_once():
    """In the training loop the first signal waits for the step to end (the ranks then save); a
    second one, in a process of its own, does not wait for the save."""
    with stop_on_signals() as state:
        with stop_after_step(timeout_s=30) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            _let_handlers_run()
            assert stop["signum"] == signal.SIGTERM and stop["pending"]
            with pytest.raises(Stopped):
                os.kill(os.getpid(), signal.SIGINT)
                _let_handlers_run()
        assert state["signum"] == signal.SIGTERM and not state["pending"]


@pytest.mark.parametrize("world", ["2", None])
def test_a_stop_that_takes_too_long_exits_hard(world):
    """A rank (WORLD_SIZE set), or a process of its own (one long kernel: a large step on a CPU), still busy
    stop_timeout_s after the signal is ended by the watch thread with 128 + signal, whatever its main thread
    is doing; a process of its own says so in one line."""
    script = ("import os, signal, time\n"
              "from teratrain.launch import stop_on_signals, stop_after_step\n"
              "with stop_on_signals(), stop_after_step(timeout_s=0.5):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | ({"WORLD_SIZE": world} if world else {})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 143 and time.monotonic() - t0 < 30
    assert ("still running 0.5 s after it" in proc.stderr) == (world is None), proc.stderr


def test_a_process_of_its_own_that_left_the_block_is_not_ended():
    """Once the block is over (the stop was handled in time), the watch thread leaves the process alone."""
    script = ("import os, signal, time\n"
              "from teratrain.launch import Stopped, stop_on_signals\n"
              "try:\n"
              "    with stop_on_signals() as state:\n"
              "        state['timeout_s'] = 0.5\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(5)\n"
              "except Stopped:\n"
              "    time.sleep(1.5)\n"
              "    print('alive')\n")
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stderr
