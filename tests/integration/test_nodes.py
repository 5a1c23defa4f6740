"""Several nodes through plain torchrun, two agents on this machine standing for two nodes (c10d
rendezvous on 127.0.0.1, one worker each, gloo, the tiny model; tests/integration/nodes.py):

(a) a 2-node run equals a `--nproc 2` run step for step;
(b) a worker killed mid-run under --max-restarts 1 is restarted, resumes from the latest checkpoint
    by itself (checkpoint.resume is auto under torchrun) and ends with the losses of the run never
    interrupted, bitwise;
(c) a lost node (agent and worker killed, or stopped: silent) ends the other node's worker within
    parallel.timeout_s, with one sentence naming its rank, the operation, the group and the lost
    peer, in error.log and torchrun's own report too;
(d) under --nnodes 1:2 the job restarts on the node left, at dp=1: the checkpoint of 2 ranks is
    resharded, the global batch kept (accumulation 2 instead of 1).

Every worker runs one CPU thread (OMP_NUM_THREADS=1, as torchrun gives each of `--nproc 2`'s ranks),
so both sides of a comparison compute alike.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.integration import nodes
from tests.integration.runner import metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nodes.Path("/proc").is_dir(), reason="finds processes in /proc")]


@pytest.fixture(scope="module")
def reference(cli, tmp_path_factory):
    """The job on 2 processes of one machine (`--nproc 2`), never interrupted."""
    out = tmp_path_factory.mktemp("nproc") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as the nodes' workers (torchrun's own default for 2 local ranks)
        cli.train(out, *nodes.SETS, steps=nodes.STEPS, nproc=2)
    return metrics(out)


@pytest.fixture
def job(cli, tmp_path):
    """Start a 2-node job (nodes.start); every process it left is killed at teardown."""
    started = []

    def start(*sets, **kw):
        started.append(nodes.start(tmp_path / "run", tmp_path / "job", cli.cache, *sets, **kw))
        return started[-1]

    yield start
    for j in started:
        j.kill()


def losses(records: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_two_nodes_equal_two_local_processes(job, reference, tmp_path):
    j = job()
    assert j.wait() == [0, 0], j.log(0) + j.log(1)
    run = metrics(tmp_path / "run")
    assert [r["step"] for r in run] == list(range(1, nodes.STEPS + 1))
    assert losses(run) == losses(reference)
    assert "device: cpu, 2 process(es)" in j.log(0) + j.log(1)


def test_a_killed_worker_is_restarted_and_resumes_by_itself(job, reference, tmp_path):
    """Node 0's worker is in a long step (5 s) when node 1's is killed, so its agent most likely restarts
    it because node 1 rejoined, not because it failed: only node 1's TORCHELASTIC_RESTART_COUNT moves
    (the attempts must not be told apart by it)."""
    j = job(max_restarts=1, faults={1: "kill-worker@7", 0: "sleep@7:5"})
    assert j.wait() == [0, 0], j.log(0) + j.log(1)
    both = j.log(0) + j.log(1)
    assert "resume=auto: " in both and "holds checkpoints: continuing its run" in both
    assert f"resumed from step 5 of {tmp_path / 'run'}; settings unchanged" in both
    assert losses(metrics(tmp_path / "run")) == losses(reference)  # steps 6-12 after the restart too
    seconds = j.marker("first_step") - j.marker("struck")
    print(f"kill -> first step after the restart: {seconds:.1f} s")
    assert seconds < 60


@pytest.mark.parametrize("fault", ["kill-node@3", "stop-node@3"])
def test_a_lost_node_ends_the_other_in_one_sentence(job, tmp_path, fault):
    """Killed, the node's connections reset and the other node knows at once; stopped (as one cut off
    or powered down), they stay open and the other node's wait ends parallel.timeout_s after it began."""
    timeout_s = 10
    j = job(f"parallel.timeout_s={timeout_s}", faults={1: fault})
    silent = fault.startswith("stop")
    codes, ended = j.wait(nodes=(0,) if silent else (0, 1)), time.time()
    assert codes == ([1] if silent else [1, -9]), j.log(0)
    assert ended - j.marker("struck") < timeout_s + 5  # + the watchdog's poll (1 s) and the exit
    errors = [ln for ln in j.log(0).splitlines() if ln.startswith("teratrain: error:")]
    assert len(errors) == 1, j.log(0)
    sentence = errors[0].removeprefix("teratrain: error: ")
    if not silent:
        assert re.match(r"rank [01]: a peer was lost during an? [a-z -]+ on group \w+ \(ranks 0, 1\) \(.+: its "
                        r"process or node ended\); no checkpoint was written yet; details in .*error\.log$", sentence)
    else:
        assert re.match(rf"rank [01] waited over parallel.timeout_s={timeout_s} s for an? [a-z -]+ on group \w+ "
                        r"\(ranks 0, 1\) that never completed: a peer never joined it \(a peer was lost", sentence)
    assert "Traceback" not in j.log(0).split(sentence)[0]  # no traceback of the worker's own before it
    log = (tmp_path / "run" / "error.log").read_text()
    assert sentence in log and ("Traceback" in log or "--- thread main" in log)
    assert f"traceback : {sentence}" in j.log(0)  # torchrun's report quotes it


def test_a_restart_on_one_node_resumes_at_dp_1(job, reference, tmp_path):
    # the lost node is declared gone after keep_alive_interval x keep_alive_max_attempt without a
    # heartbeat (default 5 s x 3), then the rendezvous waits last_call_timeout (30 s) for more nodes;
    # at the start, the second node must join within last_call_timeout of the first
    j = job(nodes="1:2", max_restarts=1, faults={1: "kill-node@7"},
            rdzv="last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3")
    codes = j.wait()
    assert codes[0] == 0 and codes[1] == -9, j.log(0)
    after = j.log(0).split("teratrain: error: ")[-1]
    assert "device: cpu, 1 process(es)" in after
    assert "layout: dp=1 tp=1 pp=1 ep=1" in after and "accumulation 2 x micro-batch 4" in after
    assert f"resumed from step 5 of {tmp_path / 'run'}" in after
    run = metrics(tmp_path / "run")
    assert [r["step"] for r in run] == list(range(1, nodes.STEPS + 1))
    assert losses(run[:5]) == losses(reference[:5])
    for r, ref in zip(run[5:], reference[5:]):  # the same global batch, summed in another order
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
