"""Data-parallel sync modes on gloo ranks against one process on the same global batch (fp32).

- local-sgd, sync_every=1, SGD with momentum, train.grad_clip=0 (each rank would clip by its own
  local norm), on 2 and 4 ranks == the single-process run (which all-reduce DP equals, see
  test_zero_parity): 1e-5 relative on every loss and final parameter tensor (||a-b|| / ||b||).
- local-sgd, sync_every=4: replicas identical right after a sync, different between syncs, the
  model differs from synchronous training, and the loss still falls.
- param-server, staleness=0 (SGD; AdamW with eps=1e-6 as in test_zero_parity), with global-norm
  clipping on: 2 workers + 1 server, 3 workers + 1 server, 2 workers + 2 servers (sharded by
  parameter) == the single-process run, 1e-5 relative.
- param-server asynchronous and staleness=1 with a straggler (worker 2 sleeps before each step):
  the loss falls and every step reports staleness >= 0; asynchronous fast workers run more than s
  clocks ahead of the straggler, under SSP they never do, and no SSP gradient is staler than the
  bound the protocol guarantees, (W - 1)(2s + 1) server updates (derived in parallel/param_server.py).
- --resume: 8 steps, then resume to 16 == 16 straight, bitwise (losses, grad norms, every rank's
  checkpoint tensors), for local-sgd (checkpoint between syncs) and synchronous param-server.

Measured (torch 2.13 CPU): losses ~1e-7 everywhere; parameters ~2e-7 for local-sgd, ~3e-8 for
param-server SGD, 2e-7 (2 workers) to 1.2e-6 (3 workers) for param-server AdamW. One or two
servers give the same numbers here (the global clipping norm is summed from per-tensor norms).
"""

import pytest
import torch
from safetensors.torch import load_file

from harness import run_ranks
from teratrain.config import ConfigError, load_config
from teratrain.mesh import ParallelDims
from teratrain.metrics import read_metrics
from teratrain.parallel.param_server import assign
from teratrain.parallel.support import check_supported
from workers import max_rel_diff, reference, train_many

TOL = 1e-5
LSGD = ["parallel.sync=local-sgd", "optim.name=sgd", "optim.lr=0.1", "train.grad_clip=0"]
PS = ["parallel.sync=param-server", "train.global_batch=12"]  # 12 splits over 2 and 3 workers of micro-batch 2
# AdamW at the default lr 3e-3: at lr=0.01 the eps amplification explained in test_zero_parity puts the
# 3-way split of this batch at ~1e-5 (7e-6 for all-reduce DP on 4 ranks, 1e-5 here), too close to TOL
PS_OPTIMS = {"sgd": ["optim.name=sgd", "optim.lr=0.01"],
             "adamw": ["optim.name=adamw", "optim.lr=0.003", "optim.eps=1e-6"]}
PS_LAYOUTS = {"2w+1s": (3, []), "3w+1s": (4, []), "2w+2s": (4, ["parallel.num_servers=2"])}
RESUME = ["model.dropout=0.1", "optim.schedule=constant"]  # constant lr: the halves set train.steps 8 and 16
ASYNC = PS + ["optim.lr=0.003", "train.steps=30"]
STRAGGLER = {"slow_rank": 2, "delay_s": 0.15}
SSP_S, SSP_WORKERS = 1, 3


def resume_runs(overrides, root):
    """16 straight; 8; then --resume to 16 in the same folder."""
    return [(overrides + ["train.steps=16"], f"{root}-straight"), (overrides + ["train.steps=8"], f"{root}-resumed"),
            (overrides + ["train.steps=16"], f"{root}-resumed", {"resume": True})]


@pytest.fixture(scope="module")
def refs(dist_workdir):
    """Single-process references: local-sgd's SGD (global batch 16), param-server's SGD/AdamW (12)."""
    out = {"lsgd": reference(LSGD[1:], str(dist_workdir / "ref-lsgd"))}
    for name, opt in PS_OPTIMS.items():
        out[name] = reference(opt + ["train.global_batch=12"], str(dist_workdir / f"ref-ps-{name}"))
    return out


@pytest.fixture(scope="module")
def world2(dist_workdir):
    d = dist_workdir
    runs = [(LSGD, f"{d}/lsgd1-w2"),
            (LSGD + ["parallel.sync_every=4", "checkpoint.every=4", "checkpoint.keep=3"], f"{d}/lsgd4-w2"),
            *resume_runs(LSGD + RESUME + ["parallel.sync_every=3"], f"{d}/lsgd-resume")]
    return spawn(2, runs, ["lsgd1", "lsgd4", "straight", "half", "resumed"])


@pytest.fixture(scope="module")
def world3(dist_workdir):
    d = dist_workdir
    runs = [(PS + opt + ["parallel.staleness=0"], f"{d}/ps-2w+1s-{name}") for name, opt in PS_OPTIMS.items()]
    runs += resume_runs(PS + PS_OPTIMS["adamw"] + RESUME + ["parallel.staleness=0"], f"{d}/ps-resume")
    names = [f"2w+1s-{n}" for n in PS_OPTIMS] + ["straight", "half", "resumed"]
    return spawn(3, runs, names)


@pytest.fixture(scope="module")
def world4(dist_workdir):
    d = dist_workdir
    runs, names = [(LSGD, f"{d}/lsgd1-w4")], ["lsgd1"]
    for layout in ("3w+1s", "2w+2s"):
        for name, opt in PS_OPTIMS.items():
            runs.append((PS + opt + PS_LAYOUTS[layout][1] + ["parallel.staleness=0"], f"{d}/ps-{layout}-{name}"))
            names.append(f"{layout}-{name}")
    ssp = ASYNC + [f"parallel.staleness={SSP_S}", "train.steps=12"]
    runs += [(ASYNC, f"{d}/ps-async", STRAGGLER), (ssp, f"{d}/ps-ssp", STRAGGLER)]
    names += ["async", "ssp"]
    return spawn(4, runs, names)


def spawn(world: int, runs: list, names: list[str]) -> dict[str, list[dict]]:
    """Every run in one set of `world` processes; name -> the results of every rank, in rank order."""
    per_rank = run_ranks(train_many, world, runs, timeout_s=600)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


def assert_matches(got: dict, ref: dict, what: str) -> tuple[float, float]:
    assert len(got["losses"]) == len(ref["losses"]) == 10
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    param_err = max_rel_diff(got["params"], ref["params"])
    assert loss_err < TOL, f"{what}: losses differ by {loss_err:.2e}"
    assert param_err < TOL, f"{what}: parameters differ by {param_err:.2e}"
    return loss_err, param_err


def checkpoint(run, step: int, rank: int) -> dict[str, torch.Tensor]:
    return load_file(f"{run}/checkpoints/step_{step:08d}/rank{rank:05d}.safetensors")


def replica(run, step: int, rank: int) -> dict[str, torch.Tensor]:
    """The parameters rank `rank` saved: local SGD saves each replica (keys `param/<name>#<dp rank>`)."""
    return {k.partition("#")[0]: v for k, v in checkpoint(run, step, rank).items() if k.startswith("param/")}


# ---------------------------------------------------------------- local SGD

@pytest.mark.parametrize("world", [2, 4])
def test_local_sgd_every_step_equals_allreduce(world, refs, request):
    got = request.getfixturevalue(f"world{world}")["lsgd1"][0]
    assert_matches(got, refs["lsgd"], f"local-sgd sync_every=1 on {world} ranks")


def test_local_sgd_averages_replicas_every_sync_every_steps(world2, refs, dist_workdir):
    run = f"{dist_workdir}/lsgd4-w2"
    for step in (4, 8):  # right after a sync: every replica holds the same bits
        a, b = replica(run, step, 0), replica(run, step, 1)
        assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"replicas differ at step {step}"
    a, b = replica(run, 10, 0), replica(run, 10, 1)
    assert any(not torch.equal(a[k], b[k]) for k in a), "replicas synced between syncs"
    got = world2["lsgd4"][0]
    assert max_rel_diff(got["params"], refs["lsgd"]["params"]) > 100 * TOL, "sync_every=4 trained like all-reduce"
    losses = got["losses"]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, f"loss did not fall: {losses}"


# ---------------------------------------------------------------- parameter server

@pytest.mark.parametrize("optim", list(PS_OPTIMS))
@pytest.mark.parametrize("layout", list(PS_LAYOUTS))
def test_synchronous_param_server_equals_single_process(layout, optim, refs, request):
    world = PS_LAYOUTS[layout][0]
    ranks = request.getfixturevalue(f"world{world}")[f"{layout}-{optim}"]
    assert [r["server"] for r in ranks].count(True) == (2 if layout == "2w+2s" else 1)
    assert all(r["staleness_max"] == 0 for r in ranks if not r["server"])
    assert_matches(ranks[0], refs[optim], f"param-server {layout} {optim}")
    if layout == "2w+2s":  # sharded by whole parameters: the servers' sets are disjoint and cover the model
        owned = [set(r["params"] or ()) for r in ranks if r["server"]]
        assert not owned[0] & owned[1] and owned[0] | owned[1] == set(ranks[0]["params"])


def test_async_param_server_converges_and_reports_staleness(world4, dist_workdir):
    rows = read_metrics(dist_workdir / "ps-async" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(0 <= r["staleness"] <= r["staleness_max"] for r in rows), rows
    losses = [r["loss"] for r in rows]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"asynchronous training did not converge: {losses}"
    assert max(r["clock_lead"] for r in rows) > SSP_S, "no worker ran ahead of the straggler"
    worst = max(r["staleness_max"] for r in world4["async"] if not r["server"])
    assert worst >= 1, "no gradient was ever applied stale: the run was not asynchronous"


def test_bounded_staleness_never_exceeds_its_guarantee(world4, dist_workdir):
    rows = read_metrics(dist_workdir / "ps-ssp" / "metrics.jsonl")
    assert max(r["clock_lead"] for r in rows) <= SSP_S, "a worker ran more than s clocks ahead"
    workers = [r for r in world4["ssp"] if not r["server"]]
    assert len(workers) == SSP_WORKERS
    bound = (SSP_WORKERS - 1) * (2 * SSP_S + 1)
    worst = max(r["staleness_max"] for r in workers)
    assert worst <= bound, f"staleness {worst} exceeds the SSP bound {bound}"
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, f"SSP training did not converge: {losses}"


# ---------------------------------------------------------------- resume

@pytest.mark.parametrize("mode,world", [("lsgd", 2), ("ps", 3)])
def test_resume_is_bitwise(mode, world, request, dist_workdir):
    ranks = request.getfixturevalue(f"world{world}")
    straight, resumed = (dist_workdir / f"{mode}-resume-{x}" for x in ("straight", "resumed"))
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 17))
    for col in ("loss", "lr", "grad_norm"):
        assert [r[col] for r in a] == [r[col] for r in b], col
    for rank in range(world):
        ta, tb = checkpoint(straight, 16, rank), checkpoint(resumed, 16, rank)
        assert ta.keys() == tb.keys() and "rng.torch_cpu" in ta
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"rank {rank}: {k}"
    if mode == "ps":  # servers hold the optimizer state, workers none
        assert any(k.startswith("optim.") for k in checkpoint(straight, 16, world - 1))
        assert not any(k.startswith("optim.") for k in checkpoint(straight, 16, 0))
    for k, v in ranks["straight"][0]["params"].items():
        assert torch.equal(v, ranks["resumed"][0]["params"][k]), k


# ---------------------------------------------------------------- layout and config (no processes)

def test_servers_are_extra_ranks_after_the_workers():
    pcfg = load_config(None, ["parallel.sync=param-server", "parallel.num_servers=2"]).parallel
    dims = ParallelDims.from_config(pcfg, 5)
    assert (dims.dp, dims.num_servers, dims.workers, dims.world) == (3, 2, 3, 5)
    with pytest.raises(ConfigError, match="parallel.num_servers=2 leaves no worker"):
        ParallelDims.from_config(pcfg, 2)
    pcfg = load_config(None, ["parallel.sync=param-server", "parallel.dp=2"]).parallel
    with pytest.raises(ConfigError, match=r"parallel.dp\*tp\*pp \+ num_servers = 3 but 4 processes"):
        ParallelDims.from_config(pcfg, 4)


def test_parameters_are_balanced_whole_over_servers():
    numels = [100, 10, 60, 50, 5, 40]
    owned = assign(numels, 2)
    assert sorted(i for o in owned for i in o) == list(range(6))  # each parameter on exactly one server
    # largest first onto the lighter server: 100 | 60, 50 | +40 | +10, +5  ->  140 vs 125 elements
    assert owned == [[0, 5], [1, 2, 3, 4]]
    assert assign(numels, 2) == owned  # deterministic
    with pytest.raises(ConfigError, match="parallel.num_servers=7 exceeds"):
        assign(numels, 7)


@pytest.mark.parametrize("sets,key", [(["parallel.staleness=0"], "staleness"),
                                      (["parallel.sync_every=4"], "sync_every"),
                                      (["parallel.sync=local-sgd", "parallel.num_servers=2"], "num_servers")])
def test_a_sync_key_without_its_mode_is_refused(sets, key):
    with pytest.raises(ConfigError, match=f"parallel.{key}=.* only applies to parallel.sync="):
        check_supported(load_config(None, sets))
