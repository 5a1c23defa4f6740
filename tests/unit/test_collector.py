"""teratrain/collector.py: the training loop's garbage-collector policy."""

import gc
import weakref

import pytest

from teratrain import collector
from teratrain.collector import Collector


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    collector._running[0] = 0
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_setup_objects_are_frozen_and_released_at_the_end():
    setup = [_Cycle() for _ in range(100)]
    with Collector() as c:
        assert gc.get_freeze_count() >= 100  # the setup's objects: never visited again
        assert gc.isenabled()  # automatic collection stays on over the new objects
        frozen = gc.get_freeze_count()
        made = [_Cycle() for _ in range(50)]  # the first step's long-lived objects
        c.step(1)
        assert gc.get_freeze_count() >= frozen + 50
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    del setup, made


def test_a_cycle_dropped_before_the_start_is_collected_not_frozen():
    gc.disable()  # only the Collector's own collection may free it
    x = _Cycle()
    ref = weakref.ref(x)
    del x  # unreachable but alive: only the collector frees a cycle
    with Collector():
        assert ref() is None
    assert not gc.isenabled()  # as it found it


def test_manual_collects_on_every_nth_step_on_every_rank_alike():
    with Collector(every=3) as c:
        assert not gc.isenabled()
        c.step(1)  # the first step freezes
        x = _Cycle()
        ref = weakref.ref(x)
        del x
        c.step(2)
        assert ref() is not None  # automatic collection is off
        c.step(3)
        assert ref() is None
    assert gc.isenabled()


def test_a_finished_run_is_collected_even_where_the_process_had_frozen_objects():
    """Python 3.12 counts objects as frozen from its start (its collector parks its immortal objects in
    the permanent generation); a Collector that then left everything frozen would keep each finished
    run's model alive (cycles) until the device runs out of memory."""
    gc.freeze()  # as Python 3.12 starts
    assert gc.get_freeze_count() > 0
    model = _Cycle()
    ref = weakref.ref(model)
    with Collector() as c:
        c.step(1)
    assert gc.get_freeze_count() == 0  # (a collection then parks 3.12's immortal objects there again)
    del model
    gc.collect()
    assert ref() is None


def test_a_nested_collector_leaves_the_outer_runs_objects_frozen():
    with Collector():
        before = gc.get_freeze_count()
        with Collector():
            pass
        assert gc.get_freeze_count() >= before > 0
    assert gc.get_freeze_count() == 0


def test_an_error_in_the_loop_restores_the_collector():
    with pytest.raises(RuntimeError):
        with Collector(every=2):
            raise RuntimeError("a step failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_every_is_a_train_setting():
    from teratrain.config import ConfigError, load_config

    assert load_config(None, ["train.gc_every=50"]).train.gc_every == 50
    with pytest.raises(ConfigError):
        load_config(None, ["train.gc_every=-1"])


def test_an_interrupted_start_leaves_later_runs_collectable(monkeypatch):
    """A Ctrl-C during the start's collection (100-180 ms on a real model) must not leave the process
    counted as inside a run, or no later Collector would unfreeze."""
    def interrupted():
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(collector, "_freeze", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with Collector():
                pass
    model = _Cycle()
    ref = weakref.ref(model)
    with Collector() as c:
        c.step(1)
    assert gc.get_freeze_count() == 0
    del model
    gc.collect()
    assert ref() is None


def test_one_collector_is_not_entered_twice():
    c = Collector(every=2)
    with c:
        with pytest.raises(RuntimeError):
            with c:
                pass
    assert gc.isenabled()
