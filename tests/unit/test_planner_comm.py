"""The planner's communication terms: measured collective terms replace NVLink's inside a node (from
--hw or a --hw-file), and every tensor-parallel form is priced by the collectives its layers issue."""

import json
from dataclasses import replace

import pytest

from teratrain.config import load_config
from teratrain.planner.comm import collective, p2p_s, regather_s, tp_per_microbatch
from teratrain.planner.hardware import GPUS, gpu_with, read_hw_file
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout
from tests.unit.test_planner_cli import plan_json

H100 = GPUS["h100"]


def test_measured_terms_replace_nvlink_for_their_kind_inside_a_node():
    gpu = gpu_with("h100", {"all_gather_gbps": 120.0, "all_gather_alpha_s": 2e-5})
    assert gpu.link("all_gather", 8) == (120.0, 2e-5)
    assert gpu.link("all_reduce", 8) == (H100.nvlink_gbps, H100.alpha_intra_s)  # not measured: NVLink
    assert gpu.link("all_gather", 16) == (H100.inter_node_gbps, H100.alpha_inter_s)  # across nodes


def test_rings_across_nodes_run_over_the_nics_of_their_members_on_a_node():
    """Across nodes a ring collective runs one ring per NIC of the group's members on a node (NCCL: a node's
    4 NICs of 12.5 GB/s reach 48 GB/s), at most at NVLink's rate; a send and an all-to-all cross at one
    GPU's NIC. The presets have one NIC per GPU."""
    nic = H100.inter_node_gbps
    assert H100.link("all_reduce", 32, 32) == (8 * nic, H100.alpha_inter_s)  # dp 32 on 4 nodes: 8 a node
    assert H100.link("all_gather", 64, 32)[0] == 4 * nic  # tp 2 inside each node: 4 members a node
    assert H100.link("reduce_scatter", 32, 4)[0] == nic  # tp 8 inside each node: one member a node
    assert H100.link("p2p", 16, 2)[0] == H100.link("all_to_all", 32, 32)[0] == nic
    assert H100.link("all_reduce", 12, 12)[0] == 4 * nic  # 8 + 4 members: the emptier node's 4 NICs
    assert H100.link("all_reduce", 12, 3)[0] == nic  # tp 4 inside: 2 + 1 members
    assert replace(H100, inter_node_gbps=100.0).link("all_reduce", 16, 16)[0] == H100.nvlink_gbps
    assert replace(H100, all_reduce_gbps=300.0).link("all_reduce", 16, 16)[0] == 300.0  # no faster than inside
    assert collective("all_reduce", 32, 1e9, *H100.link("all_reduce", 32, 32)) < collective(
        "all_reduce", 32, 1e9, *H100.link("all_reduce", 32)) / 6


def test_expert_gradients_reduce_over_the_gpus_their_replicas_spread_on():
    """An expert's replicas (dp / ep ranks holding it) sit ep x tp GPUs apart over the whole dp range (mesh.py):
    at dp 128, ep 4, 2 of them on each node, so their reduction crosses at 2 NICs; at dp 64, ep 8, one a node
    (the group spans 8 nodes, not one)."""
    from teratrain.planner.comm import dp_terms

    shape, train = _llama()
    w = train.widths(0)
    for dp, ep, nics in ((128, 4, 2), (64, 8, 1)):
        lay = Layout(dp=dp, ep=ep)
        got = dp_terms(train, lay, w, 10**8, dp // ep, H100, (1, 1), 0, dp * lay.tp)["dp"]
        want = collective("all_reduce", dp // ep, 10**8 * train.reduce_bytes, nics * H100.inter_node_gbps,
                          H100.alpha_inter_s)
        assert got == pytest.approx(want)


def _llama(*sets):
    cfg = load_config(None, ["model.preset=llama-1b", "memory.precision=bf16", *sets])
    return shape_of(cfg), training_of(cfg)


def test_tensor_parallel_forms_issue_their_layers_collectives():
    """Per block and micro-batch: megatron crosses 2 regions each way (all-reduces, or an all-gather
    and a reduce-scatter each under sequence parallelism), a third time forward when the blocks are
    replayed; the all-gather form gathers every linear's output forward and all-reduces its input's
    gradient backward, the all-reduce form the other way round."""
    shape, train = _llama()
    c, n = shape.cfg, 2 * shape.cfg.seq_len
    d, kv, ff = c.d_model, c.kv_heads * c.head_width, c.ffn_dim
    gbps, alpha = H100.link("all_reduce", 2)

    def coll(kind, elems):
        return collective(kind, 2, elems * 2, gbps, alpha)  # bf16

    vocab_plain = 2 * coll("all_reduce", n * d) + 3 * coll("all_reduce", n * 2)  # n fp32 values = 2n bf16 elements
    lay = Layout(tp=2, micro_batch=2)
    ar = coll("all_reduce", n * d)
    assert tp_per_microbatch(shape, train, lay, H100, 4) == pytest.approx(4 * 4 * ar + vocab_plain)
    replay = tp_per_microbatch(shape, train, lay.with_(recompute="full"), H100, 4)
    assert replay == pytest.approx(4 * 6 * ar + vocab_plain)
    sp = tp_per_microbatch(shape, train, lay.with_(sequence_parallel=True), H100, 4)
    unit = coll("all_gather", n * d) + coll("reduce_scatter", n * d)
    assert sp == pytest.approx(4 * 4 * unit + 2 * unit + 3 * coll("all_reduce", n * 2))
    outs, ins = [d, kv, kv, d, ff, ff, d], [d, d, d, d, d, d, ff]
    gather = sum(coll("all_gather", n * o) + coll("all_reduce", n * i) for o, i in zip(outs, ins))
    reduce = sum(coll("all_reduce", n * o) + coll("all_gather", n * i) for o, i in zip(outs, ins))
    for form, per_block in (("all-gather", gather), ("all-reduce", reduce)):
        got = tp_per_microbatch(shape, train, lay.with_(tp_form=form), H100, 4)
        assert got == pytest.approx(4 * per_block + vocab_plain), form


def test_sequence_shards_gathered_again_in_backward_expose_what_outlasts_their_gemm():
    """Eager sequence parallelism gathers the attention's and the MLP's input again in each block's backward
    and the head's once a micro-batch (parallel/comm.py Regather), each under the input-gradient GEMM of the
    first linear autograd reaches (wv, w3, the head): only what outlasts it is exposed, and the step pays it.
    Compiled steps, float8 GEMMs, ZB-H1 pipelines and the other tp forms issue none."""
    shape, train = _llama()
    c, n = shape.cfg, 2 * shape.cfg.seq_len
    slow = gpu_with("h100", {"all_gather_gbps": 5.0})  # every gather outlasts its GEMM
    lay = Layout(tp=2, micro_batch=2, num_microbatches=3, sequence_parallel=True)
    gather = collective("all_gather", 2, n * c.d_model * 2, *slow.link("all_gather", 2))
    rate = slow.sustained_flops("bf16", c.d_model)
    gemms = [2 * n * c.d_model * width / 2 / rate for width in (c.kv_heads * c.head_width, c.ffn_dim)]
    total, exposed = regather_s(shape, train, lay, slow)
    layers = c.n_layers
    assert total == pytest.approx(3 * (2 * layers + 1) * gather)
    head = 2 * n * c.d_model * c.vocab_size / 2 / rate
    assert exposed == pytest.approx(3 * (layers * sum(gather - g for g in gemms) + max(0.0, gather - head)))
    assert 0 < regather_s(shape, train, lay, H100)[1] < regather_s(shape, train, lay, H100)[0]
    for off, other in ((train, lay.with_(sequence_parallel=False)), (train, lay.with_(tp_form="all-gather")),
                       (replace(train, compiled=True), lay), (replace(train, fp8="rowwise"), lay),
                       (train, lay.with_(pp=2, schedule="zb-h1"))):
        assert regather_s(shape, off, other, slow) == (0.0, 0.0)
    from teratrain.planner.search import evaluate
    step = evaluate(shape, train, lay, slow).time
    assert step.terms["comm_regather_s"] == pytest.approx(total)
    assert step.comm_exposed_s >= exposed


def test_pipeline_send_is_a_sequence_shard_under_sequence_parallelism():
    shape, train = _llama()
    whole = p2p_s(shape, train, Layout(pp=2, micro_batch=2), H100)
    shard = p2p_s(shape, train, Layout(pp=2, tp=2, micro_batch=2, sequence_parallel=True), H100)
    gbps, alpha = H100.link("p2p", 2)
    assert whole == pytest.approx(alpha + 2 * shape.cfg.seq_len * shape.cfg.d_model * 2 / (gbps * 1e9))
    assert shard - alpha == pytest.approx((whole - alpha) / 2)


def test_pipeline_send_without_sequence_parallelism_is_scattered_over_tp():
    """tp=8 on a node, stages on other nodes: 1/8 of the message crosses the inter-node link and the
    receiving node all-gathers the pieces over NVLink (Narayanan et al. 2021 sec. 4.1)."""
    shape, train = _llama()
    lay = Layout(pp=2, tp=8, micro_batch=2)
    act = 2 * shape.cfg.seq_len * shape.cfg.d_model * 2
    gbps, alpha = H100.link("p2p", 16)
    gather = collective("all_gather", 8, act, *H100.link("all_gather", 8))
    assert p2p_s(shape, train, lay, H100) == pytest.approx(alpha + act / 8 / (gbps * 1e9) + gather)
    assert p2p_s(shape, train, lay, H100) < (alpha + act / (gbps * 1e9)) / 2  # under half the whole send


def test_hw_file_feeds_the_plan(capsys, tmp_path):
    """A planner_validate result's "hw" and "gpu_preset" become the plan's assumptions; --hw wins."""
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"gpu_preset": "h200", "hw": {"all_reduce_gbps": 123.0, "pcie_gbps": 31.5}}))
    assert read_hw_file(str(path)) == ({"all_reduce_gbps": 123.0, "pcie_gbps": 31.5}, "h200")
    d = plan_json(capsys, "--model", "gpt2-124m", "--gpus", "2", "--hw-file", str(path), "--hw", "pcie_gbps=20")
    assert d["gpu"] == "h200" and d["assumptions"]["all_reduce_gbps"] == 123.0 and d["assumptions"]["pcie_gbps"] == 20
    (tmp_path / "flat.json").write_text(json.dumps({"p2p_gbps": 300}))
    assert read_hw_file(str(tmp_path / "flat.json")) == ({"p2p_gbps": 300.0}, None)
    (tmp_path / "bad.json").write_text(json.dumps({"hw": {"warp_gbps": 1}}))
    with pytest.raises(ValueError, match="'warp_gbps' is not a hardware term"):
        read_hw_file(str(tmp_path / "bad.json"))


def test_reductions_not_overlapped_are_exposed_whole():
    """parallel.overlap_comm=false waits for each gradient reduction where it is launched (parallel/data.py):
    the step carries all of it, where overlapped it hides behind the last micro-batch's backward."""
    from teratrain.planner.inputs import layout_of
    from teratrain.planner.search import evaluate

    def timed(overlap):
        cfg = load_config(None, ["model.preset=llama-1b", "memory.precision=bf16", "parallel.dp=16",
                                 "train.global_batch=32", "train.micro_batch=2", f"parallel.overlap_comm={overlap}"])
        return evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, 16), H100).time

    hidden, waited = timed("true"), timed("false")
    dp_s = waited.terms["comm_dp_s"]
    assert dp_s == pytest.approx(hidden.terms["comm_dp_s"]) and dp_s > 0.01
    assert waited.comm_exposed_s == pytest.approx(dp_s) and hidden.comm_exposed_s < dp_s
    assert waited.step_time_s - hidden.step_time_s == pytest.approx(dp_s - hidden.comm_exposed_s, rel=1e-6)
