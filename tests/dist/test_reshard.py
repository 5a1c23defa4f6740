"""Checkpoints reshard to any layout (fp32, AdamW, dropout off, gloo CPU ranks).

A run saved at one layout resumes at another: every continued step's loss equals the run that never
changed layout (one process, the same global batches) within 1e-5 relative, and saving right after
the load gives byte-identical logical tensors (parameters and every optimizer moment), whichever
layouts wrote and read them. Measured: about 1e-7 on losses (fp32 summation order differs across
layouts, as in test_tensor_parallel.py)."""

import torch

from harness import run_ranks
from reshard_workers import job, jobs, logical_tensors

K, N = 3, 6  # save after K steps, continue to N
TOL = 1e-5


def reference(overrides: list[str] = ()) -> list[float]:
    """The unchanged run: one process, N steps straight."""
    return job(0, 1, list(overrides), N)


def assert_continues(losses: list[float], ref: list[float], what: str) -> None:
    assert len(losses) == N - K, what
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref[K:]))
    assert err < TOL, f"{what}: continued losses differ from the unchanged run by {err:.2e}"


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, a.keys() ^ b.keys())
    assert any(k.startswith("optim.exp_avg/") for k in a) and any(k.startswith("optim.step/") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def test_zero3_dp2_resumes_at_dp4_zero1_at_dp1_and_with_offload(tmp_path):
    ref = reference()
    saved, z2, b, c = (str(tmp_path / x) for x in ("dp2-z3", "dp2-z2-offload", "dp4-z1", "dp1"))
    first = run_ranks(jobs, 2, [
        dict(overrides=["parallel.zero=3"], steps=K, save_to=saved),
        dict(overrides=["parallel.zero=2", "parallel.offload=optimizer"], steps=N, resume_from=saved)])[0]
    assert max(abs(x - y) / y for x, y in zip(first[0], ref[:K])) < TOL
    assert_continues(first[1], ref, "dp=2 zero=3 -> dp=2 zero=2 offload=optimizer")
    at4 = run_ranks(jobs, 4, [dict(overrides=["parallel.zero=1"], steps=N, resume_from=saved, save_first=b)])[0][0]
    assert_continues(at4, ref, "dp=2 zero=3 -> dp=4 zero=1")
    at1 = job(0, 1, [], N, resume_from=saved, save_first=c)
    assert_continues(at1, ref, "dp=2 zero=3 -> dp=1")
    original = logical_tensors(saved)
    assert_same_tensors(original, logical_tensors(b), "saved at dp=2 zero=3, resaved at dp=4 zero=1")
    assert_same_tensors(original, logical_tensors(c), "saved at dp=2 zero=3, resaved at dp=1")


def test_tensor_parallel_to_data_parallel_and_back(tmp_path):
    """tp=2 x dp=2 -> tp=1 x dp=4 and tp=1 x dp=4 -> tp=2 x dp=2 (ZeRO-1 on the tp side: pieces that
    are flat ranges of tensor-parallel slices), tp=2 -> tp=4, and tp=2 -> tp=1 -> tp=2 saves
    identical tensors."""
    ref = reference()
    tp2, tp1, back, dp4 = (str(tmp_path / x) for x in ("tp2", "tp1", "back", "dp4"))
    TP2 = ["parallel.tp=2", "parallel.zero=1"]
    got = run_ranks(jobs, 4, [
        dict(overrides=TP2, steps=K, save_to=tp2),
        dict(overrides=[], steps=N, resume_from=tp2, save_first=tp1),
        dict(overrides=TP2, steps=N, resume_from=tp1, save_first=back),
        dict(overrides=["parallel.zero=2"], steps=K, save_to=dp4),
        dict(overrides=TP2, steps=N, resume_from=dp4),
        dict(overrides=["parallel.tp=4"], steps=N, resume_from=tp2)])[0]
    assert_continues(got[1], ref, "tp=2 x dp=2 -> tp=1 x dp=4")
    assert_continues(got[2], ref, "tp=1 x dp=4 -> tp=2 x dp=2 (after a round trip)")
    assert_continues(got[4], ref, "tp=1 x dp=4 zero=2 -> tp=2 x dp=2 zero=1")
    assert_continues(got[5], ref, "tp=2 -> tp=4 (vocabulary padded to 52, key/value heads replicated)")
    original = logical_tensors(tp2)
    assert_same_tensors(original, logical_tensors(tp1), "tp=2 saved, resaved at tp=1")
    assert_same_tensors(original, logical_tensors(back), "tp=2 -> tp=1 -> tp=2")


MOE = ["model.moe.num_experts=4"]  # softmax-topk without a capacity: routing is deterministic


def test_pipeline_and_expert_layouts_reshard(tmp_path):
    """pp=2 with ZeRO-3 -> pp=1 x dp=2 (the stages' shards meet in one model); an MoE saved with its experts over
    ep=2 ranks (ZeRO-1) -> ep=1 x dp=2 -> one process; and the tensors resaved are identical."""
    ref, moe_ref = reference(), reference(MOE)
    pp2, pp1, ep2, ep1 = (str(tmp_path / x) for x in ("pp2", "pp1", "ep2", "ep1"))
    got = run_ranks(jobs, 2, [
        dict(overrides=["parallel.pp=2", "parallel.zero=3"], steps=K, save_to=pp2),
        dict(overrides=[], steps=N, resume_from=pp2, save_first=pp1),
        dict(overrides=MOE + ["parallel.ep=2", "parallel.zero=1"], steps=K, save_to=ep2),
        dict(overrides=MOE, steps=N, resume_from=ep2, save_first=ep1)])[0]
    assert max(abs(x - y) / y for x, y in zip(got[0], ref[:K])) < TOL
    assert_continues(got[1], ref, "pp=2 zero=3 -> pp=1 x dp=2")
    assert max(abs(x - y) / y for x, y in zip(got[2], moe_ref[:K])) < TOL
    assert_continues(got[3], moe_ref, "ep=2 x dp=2 zero=1 -> ep=1 x dp=2")
    assert_continues(job(0, 1, MOE, N, resume_from=ep2), moe_ref, "ep=2 x dp=2 -> one process")
    assert_same_tensors(logical_tensors(pp2), logical_tensors(pp1), "saved at pp=2, resaved at pp=1")
    assert_same_tensors(logical_tensors(ep2), logical_tensors(ep1), "saved at ep=2, resaved at ep=1")
