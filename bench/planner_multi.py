"""Measuring layouts on N GPUs of one host in as few torchrun jobs as possible, for
bench/planner_validate.py --gpus N and --check-pick.

The driver (`run_rows`) writes a plan (rows with their --set items, steps, a deadline) and launches
one torchrun job of N processes which measures the machine (bench/machine.py: collectives, PCIe,
CPU AdamW and the host's cast; then the host probe's rows, planner_rows.probe_rows, twice) and then every
row in turn in the same processes, writing one JSON line per event. A job that dies (a rank out of
memory stalls its peers until the NCCL watchdog ends them) loses only the row it was in: the driver
records that row and relaunches the rest, at most 3 launches in all.
Rank 0 decides before each row whether the deadline leaves time for it (the planner's estimate), and
every rank follows. Then the rows the planner expects the host to pace (planner_modes.py marks them
"revisit") are measured once more, in reverse order, while the deadline leaves time: the host CPU's
speed on cloud machines shifts for seconds at a time, and such rows measured 1.1-1.7x apart between
runs where GPU-paced ones (pipelines) repeat within 2% (2 x H200; within one job, two visits were 2-18%
apart). A host-paced step is only ever slowed by what else runs, so the faster
visit's median is the row's step, with every visit's in `visits_s` and the first's in
`first_visit_step_s` (every measured row has it); its memory figures are the larger of the visits'.
The host's speed also moves between launches of the same code: on one 2 x H200 machine, 11 launches of
a 16-layer tp2 megatron step took 133-192 ms, every host gap between its collectives longer in the slow
launches, while the host probe run in the same processes did not follow. So after the main job, `relaunches` more jobs (while the deadline leaves time) each
run the host probe once and visit the host-paced rows again in fresh processes: the probe's rows and
the rows alike keep their fastest run over the launches, so both sides see the host at its best.

Per row, every rank builds the model as `teratrain train` does (meta device, parallelize(), the
trainer's step runner: train_step or the pipeline executor), runs `warmup` steps, resets the peak
counter, runs `steps` synchronized steps, and reports the peak `max_memory_allocated` above what was
allocated before the row, the allocator's reserved peak, what lives outside the allocator (CUDA
context, NCCL), its step times and, for pp = 1 without ZeRO-3, the bytes autograd saves for one
micro-batch's forward (teratrain.measure.saved_bytes). The row's figures are the largest peak of any
rank and the slowest rank's median step. Rows with the same degrees share one runtime (its process
groups and NCCL communicators); before each row the ranks align their group counters
(mesh.align_group_names) so the groups a row makes get the same names on every member.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import job_env  # noqa: E402

GIB = 2**30
LAUNCHES = 3
START_S = 20.0  # a torchrun job's start-up and NCCL's, seconds
PROBE_S = 15.0  # the host probe's four rows once, seconds


# ---------------------------------------------------------------- driver

def run_rows(rows: list[dict], nproc: int, *, smoke: bool, steps: int, warmup: int, deadline: float,
             measure_machine: bool, probes: list[dict] = (), relaunches: int = 0,
             timeout_s: int = 180) -> tuple[dict | None, dict[str, dict]]:
    """Measure `rows` ({"name", "sets", "est_s", "revisit"}) on `nproc` processes: (machine record or
    None, name -> measured figures, or {"error"} / {"skipped"}). With `measure_machine`, the machine's
    terms first, and the host probe's rows (`probes`, planner_rows.probe_rows) in its record; then up to
    `relaunches` jobs of the probe and the revisited rows (module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="planner-validate-"))
    events = work / "events.jsonl"
    machine, results, pending = None, {}, list(rows)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(work / "plan.json")]
    env = job_env()

    def job(job_rows: list[dict], **kind) -> int:
        """One torchrun job over `job_rows` (plus `kind`: measure_machine, relaunch); its events folded in."""
        nonlocal machine
        plan = {"rows": job_rows, "steps": steps, "warmup": warmup, "deadline": deadline, "out": str(events),
                "device": "cpu" if smoke else "cuda", "smoke": smoke, "timeout_s": timeout_s,
                "probes": list(probes), **kind}
        (work / "plan.json").write_text(json.dumps(plan))
        returncode = _launch(cmd, env, max(60.0, deadline - time.time() + 2 * timeout_s + 60))
        machine = _read(events, results, machine)
        return returncode

    for _ in range(LAUNCHES):
        if not pending or time.time() > deadline:
            break
        returncode = job(pending, measure_machine=measure_machine and machine is None)
        pending = [r for r in pending if r["name"] not in results]
        if returncode == 0:
            break
    for r in pending:
        results[r["name"]] = {"skipped": "not run: the time budget or the launches ran out"}
    again = [r for r in rows if r.get("revisit") and "measured_step_s" in results.get(r["name"], {})]
    for i in range(relaunches if again else 0):
        if time.time() + START_S + PROBE_S + again[0]["est_s"] > deadline:  # the worker skips what is late
            break
        # the main job's own revisits ran in reverse order: the first relaunch goes forward, so a deadline
        # does not cut the same rows every time
        job(again if i % 2 == 0 else again[::-1], measure_machine=False, relaunch=True)
    return machine, results


def _launch(cmd: list[str], env: dict, limit_s: float) -> int:
    """Run the torchrun job (its output goes to stderr: stdout carries the one JSON object); past
    `limit_s` (the deadline plus two collective timeouts: a stalled job ends by itself before that)
    end its whole process group, workers included, so no process keeps a GPU."""
    job = subprocess.Popen(cmd, env=env, stdout=sys.stderr, start_new_session=True)
    try:
        return job.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.wait()


def _read(events: Path, results: dict, machine: dict | None) -> dict | None:
    """Fold the job's events into `results`; a row started and never finished died with the job. A
    relaunch's "late" record (a visit the deadline left no time for) changes nothing."""
    started, probes = None, {}
    for line in events.read_text().splitlines() if events.exists() else []:
        e = json.loads(line)
        kind = e.pop("record")
        if kind == "machine":
            machine = e
        elif kind == "probe":  # the host probe's rows (planner_rows.probe_rows): twice, then once a relaunch
            probes[e["name"]] = _faster(probes.get(e["name"]), e, "passes_s")
        elif kind == "start":
            started = e["name"]
        elif kind == "row":
            results[e.pop("name")] = {**_faster(None, e, "visits_s"), "first_visit_step_s": e["measured_step_s"]}
            started = None
        elif kind == "revisit":  # after every row's first visit (module docstring)
            name = e.pop("name")
            if "measured_step_s" in results.get(name, {}):  # a row measured in the main job's pass
                results[name] = _faster(results[name], e, "visits_s")
        elif kind == "skipped":
            results[e.pop("name")] = {"skipped": "not run: the time budget ran out"}
            started = None
    if probes:  # they join the machine's record
        machine["host_probe"] = list(probes.values())
    if started is not None and started not in results:
        results[started] = {"error": "the job ended during this row (a rank out of memory stalls the others until "
                                     "the NCCL watchdog ends the job); its log is above"}
    return machine


def _faster(kept: dict | None, e: dict, runs: str) -> dict:
    """A probe row's or a row's figures with one more run `e` (`kept`: its runs so far, None before the
    first): the faster run's figures, as a host-paced step is only ever slowed by what else runs (on 4 x
    H100 the plain data-parallel probe, run first, measured 50 ms where a ZeRO-3 probe with more launches
    took 40), every run's step time in `runs`; memory is never understated: the peaks (and
    their per-rank list) of the run with the larger peak, the larger of what lived outside the allocator
    or stayed allocated, and a model freed only if every run freed it."""
    if kept is None:
        return {**e, runs: [e["measured_step_s"]]}
    out = {**kept, **e} if e["measured_step_s"] < kept["measured_step_s"] else dict(kept)
    out[runs] = kept[runs] + [e["measured_step_s"]]
    if "measured_peak_gib" in e:
        fuller = e if e["measured_peak_gib"] > kept["measured_peak_gib"] else kept
        out.update({k: fuller[k] for k in ("measured_peak_gib", "measured_peak_per_rank_gib") if k in fuller})
    out.update({k: max(kept[k], e[k]) for k in MEMORY_MAX if k in e and k in kept})
    if "model_freed" in e:
        out["model_freed"] = kept.get("model_freed", True) and e["model_freed"]
    return out


MEMORY_MAX = ("measured_reserved_gib", "outside_allocator_gib", "left_allocated_gib")


# ---------------------------------------------------------------- worker (one per GPU, under torchrun)

def worker(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if plan["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=plan["timeout_s"]),
                            device_id=device if device.type == "cuda" else None)
    out = open(plan["out"], "a") if rank == 0 else None

    def emit(record: dict) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    runtimes: dict = {}
    relaunch = plan.get("relaunch", False)
    if relaunch and not _agree(time.time() + PROBE_S + plan["rows"][0]["est_s"] < plan["deadline"], device):
        plan["rows"] = []  # no time for the probe and a visit: this relaunch adds nothing
    elif plan["measure_machine"] or relaunch:
        from planner_rows import PROBE_STEPS, PROBE_WARMUP

        if plan["measure_machine"]:
            emit({"record": "machine", **machine_terms(device, plan["smoke"])})  # kept if a probe ends the job
        probe = {**plan, "steps": PROBE_STEPS, "warmup": PROBE_WARMUP}
        # twice in the main job, the second pass reversed; once in a relaunch (`_faster` keeps the fastest)
        for p in plan["probes"] if relaunch else plan["probes"] + plan["probes"][::-1]:
            emit({"record": "probe", "name": p["name"], "sets": p["sets"], **measure_row(p, probe, device, runtimes)})
    # a relaunch visits again the rows the main job measured: nothing to mark as started or skipped
    late, visit = ("late", "revisit") if relaunch else ("skipped", "row")
    for row in plan["rows"]:
        if not _agree(time.time() + row["est_s"] < plan["deadline"], device):
            emit({"record": late, "name": row["name"]})
            continue
        if not relaunch:
            emit({"record": "start", "name": row["name"]})
        emit({"record": visit, "name": row["name"], **measure_row(row, plan, device, runtimes)})
    for row in [] if relaunch else [r for r in plan["rows"] if r.get("revisit")][::-1]:  # host-paced rows once more
        if not _agree(time.time() + row["est_s"] < plan["deadline"], device):
            break
        emit({"record": "revisit", "name": row["name"], **measure_row(row, plan, device, runtimes)})
    dist.barrier()
    from teratrain.mesh import shutdown

    shutdown()


def _agree(go: bool, device: torch.device) -> bool:
    """Rank 0's decision, on every rank."""
    flag = torch.tensor([1 if go else 0], device=device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def machine_terms(device: torch.device, smoke: bool) -> dict:
    """Collectives, and on GPUs the host link and CPU optimizer as every rank sees them at once (the
    slowest rank's figures: offload runs on every rank together)."""
    from machine import SIZES, SMOKE_SIZES, host_adam, host_cast, measure, pcie_gbps

    from teratrain.memory.offload import host_threads

    out = {"collectives": measure(device, SMOKE_SIZES if smoke else SIZES, 3 if smoke else 20),
           "world": dist.get_world_size()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        was, threads = torch.get_num_threads(), host_threads()
        torch.set_num_threads(threads)  # the threads the offload engine's host step gets
        try:
            mine = torch.tensor([pcie_gbps(device=device), host_adam(), host_cast()], dtype=torch.float64,
                                device=device)
        finally:
            torch.set_num_threads(was)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        out.update(device=props.name, total_bytes=props.total_memory, pcie_gbps=float(mine[0]),
                   host_adam_params_per_s=float(mine[1]), host_cast_params_per_s=float(mine[2]),
                   host_threads=threads)
    return out


def _runtime(cfg, runtimes: dict):
    """The runtime of these degrees: made once (init_runtime), then shared with its process groups."""
    from teratrain.mesh import ParallelDims, align_group_names, init_runtime

    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    if dims not in runtimes:
        runtimes[dims] = init_runtime(cfg)  # it aligns the group counters itself
    else:
        align_group_names()
    return runtimes[dims]


def _free(device: torch.device) -> int:
    """Collect the last row's objects and return the cached device and pinned host blocks (offload
    rows of different sizes would otherwise pile pinned memory up); what stays allocated."""
    from teratrain.compat import host_empty_cache

    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    host_empty_cache()
    return torch.cuda.memory_allocated(device)


def _batches(cfg, rt, device: torch.device) -> list:
    """This rank's micro-batches (the same on the tp ranks and stages of one data-parallel replica)."""
    g = torch.Generator().manual_seed(1000 + rt.dp_rank)
    mb, T, V = cfg.train.micro_batch, cfg.model.seq_len, cfg.model.vocab_size
    tokens = [torch.randint(0, V, (mb, T + 1), generator=g) for _ in range(cfg.microbatches(rt.dims.dp))]
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def build_row(sets: list[str], timeout_s: float, device: torch.device, runtimes: dict) -> tuple:
    """A row's config, runtime, model, engine and micro-batches, built as `teratrain train` builds
    them, and step(): one optimizer step on this rank's micro-batches."""
    from teratrain.config import load_config
    from teratrain.models.transformer import Transformer
    from teratrain.parallel.parallelize import parallelize
    from teratrain.parallel.pipeline.runtime import step_runner

    cfg = load_config(None, sets + [f"parallel.timeout_s={timeout_s}"])
    rt = _runtime(cfg, runtimes)
    cfg.parallel.dp = rt.dims.dp
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)
    runner = step_runner(model, engine, rt, cfg)
    micro, precision = _batches(cfg, rt, device), cfg.memory.precision
    return cfg, rt, model, engine, micro, lambda: runner(micro, precision, 1e-4)


def measure_row(row: dict, plan: dict, device: torch.device, runtimes: dict) -> dict:
    from common import sync
    from machine import host_loop_us

    from teratrain.collector import Collector
    from teratrain.measure import saved_bytes

    base, threads = _free(device), torch.get_num_threads()  # an offload row sets its own (memory/offload.py)
    cfg, rt, model, engine, micro, step = build_row(row["sets"], plan["timeout_s"], device, runtimes)
    precision = cfg.memory.precision
    loops = [host_loop_us()]
    with Collector(cfg.train.gc_every) as collector:  # the garbage collector as `teratrain train` runs it
        for _ in range(plan["warmup"]):
            step()
            collector.step()
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(plan["steps"]):
            t0 = time.perf_counter()
            stats = step()[0]
            sync(device)
            times.append(time.perf_counter() - t0)
            collector.step()
    loops.append(host_loop_us())
    mine = {"step_s": statistics.median(times), "times": [round(t, 5) for t in times],
            "loop_us": statistics.mean(loops), "engine": dict(stats.metrics)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        mine.update(peak=(torch.cuda.max_memory_allocated(device) - base) / GIB,
                    reserved=torch.cuda.max_memory_reserved(device) / GIB,
                    outside=(total - free - torch.cuda.memory_reserved(device)) / GIB)
    if rt.dims.pp == 1 and cfg.parallel.zero < 3:  # a forward on every rank: collective under tp and ep
        mine["saved"] = saved_bytes(model, *micro[0], precision, targets_in_model=True)
    alive = weakref.ref(model)
    del step, engine, model, micro
    torch.set_num_threads(threads)  # the next row starts as this one did
    mine["left_gib"] = (_free(device) - base) / GIB  # what the row left allocated (should be ~0)
    mine["model_freed"] = alive() is None  # else something (a hook, a cache) keeps the row's model alive
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return _combine(ranks)


def _combine(ranks: list[dict]) -> dict:
    """The row's figures: the fullest rank's peak, the slowest rank's step."""
    slowest = max(ranks, key=lambda r: r["step_s"])
    out = {"measured_step_s": slowest["step_s"], "step_times_s": slowest["times"],
           "step_s_per_rank": [round(r["step_s"], 5) for r in ranks],
           "model_freed": all(r["model_freed"] for r in ranks),
           # the host's speed around the row (machine.host_loop_us), the slowest rank's: it paces the ranks
           "host_loop_us": max(r["loop_us"] for r in ranks),
           "host_loop_us_per_rank": [round(r["loop_us"], 5) for r in ranks]}
    if any(r["engine"] for r in ranks):  # the engine's own figures of the last step (offload: the host's time)
        out["engine_metrics_per_rank"] = [r["engine"] for r in ranks]
    if "peak" in ranks[0]:
        out.update(measured_peak_gib=max(r["peak"] for r in ranks),
                   measured_peak_per_rank_gib=[round(r["peak"], 3) for r in ranks],
                   measured_reserved_gib=max(r["reserved"] for r in ranks),
                   outside_allocator_gib=max(r["outside"] for r in ranks),
                   left_allocated_gib=max(r["left_gib"] for r in ranks))
    if "saved" in ranks[0]:
        out["measured_saved_bytes"] = max(r["saved"] for r in ranks)
        out["measured_saved_per_rank"] = [r["saved"] for r in ranks]
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        worker(sys.argv[2])
    else:
        sys.exit("bench/planner_multi.py is run by bench/planner_validate.py --gpus N (or --check-pick)")
