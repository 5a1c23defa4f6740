"""memory.fp8_gather: ZeRO-3 gathers the float8 linears' weights in float8 (parallel/zero_fp8.py), on 2
gloo ranks through torchao's float8 emulation, against one process training in fp8 on the same global
batch (SGD, 5 steps, bf16 autocast over fp32 parameters), and bf16 parameters with fp32 masters against
ZeRO-3 gathering them in bf16.

Tolerance 1e-3, relative, on every step's loss and every final parameter tensor, as tests/dist/
test_fp8.py allows layouts that compute every GEMM on the same operands: each weight is cast with the
global amax of its shards, which is the whole weight's, so its float8 bytes and scale are the ones one
process makes (checked exactly below); only fp32 summation orders differ.
"""

import math
from unittest import mock

import pytest
import torch
from harness import run_ranks
from layout_workers import batches, build, micro_batches, train_random
from test_tensor_parallel import max_rel_diff

from teratrain import compat
from teratrain.parallel.pipeline.runtime import step_runner

try:  # torchao is the optional `fp8` extra; setup.sh installs it
    compat.torchao_float8()
except ImportError:
    pytest.skip("torchao is not installed", allow_module_level=True)

FP8 = ["model.d_model=64", "model.d_ff=128", "memory.precision=bf16", "memory.fp8=tensorwise",
       "memory.fp8_emulate=true", "optim.name=sgd", "optim.lr=0.05"]
TOL = 1e-3
MASTERS = [["memory.master_weights=false"], ["memory.master_weights=true"]]


def _many(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [train_random(rank, world, FP8 + layout, steps=5) for layout in layouts]


def test_float8_gather_matches_one_process():
    """fp32 parameters (cast to float8 from fp32): the same losses and parameters as one process
    within 1e-3. bf16 parameters with fp32 masters (cast from bf16, as one process's bf16 linear holds
    them) against ZeRO-3 gathering in bf16: ZeRO-3 with masters lands 7.9e-3 from one process on its
    own (its bf16 roundings, float8 gather or not), so the gather is checked against its own engine."""
    layouts = [MASTERS[0] + ["parallel.zero=3"], MASTERS[1] + ["parallel.zero=3"],
               MASTERS[1] + ["parallel.zero=3", "memory.fp8_gather=false"]]
    fp32, bf16, bf16_wide = run_ranks(_many, 2, layouts)[0]
    for got, ref, what in ((fp32, train_random(0, 1, FP8 + MASTERS[0], steps=5), "fp32, one process"),
                           (bf16, bf16_wide, "bf16 masters, bf16 gather")):
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        param_err = max_rel_diff(got["params"], ref["params"])
        assert loss_err < TOL and param_err < TOL, f"against {what}: losses {loss_err:.2e}, params {param_err:.2e}"


def _gathers(rank: int, world: int, overrides: list[str]) -> dict:
    """One step after a first: the input bytes of every ZeRO-3 all-gather by dtype, and whether the
    float8 weight each float8 linear found in forward is, byte for byte and scale, torchao's cast of
    the whole weight (in the compute dtype) that one process makes."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    from teratrain.memory.fp8 import float8_linears
    from teratrain.parallel import zero_gather

    cfg, rt, model, engine = build(FP8 + overrides)
    run_step = step_runner(model, engine, rt, cfg)
    steps = [micro_batches(cfg, rt, b) for b in batches(cfg, 2)]
    run_step(steps[0], cfg.memory.precision, cfg.optim.lr)
    whole = engine.full_params()  # the weights the next step's forward uses
    names = {id(p): n for n, p in model.named_parameters()}
    linears = {names[id(m.weight)]: m for m in float8_linears(model)}
    seen, bytes_by_dtype, real = {}, {}, zero_gather.all_gather

    def counting(out, inp, group, async_op=False):
        bytes_by_dtype[str(inp.dtype)] = bytes_by_dtype.get(str(inp.dtype), 0) + inp.numel() * inp.element_size()
        return real(out, inp, group, async_op=async_op)

    def keep(m, args, name):  # the first forward's float8 weight (the backward's gather refills it)
        if name not in seen:
            seen[name] = (m.float8_weight.data.clone(), m.float8_weight.scale.clone())

    for name, m in linears.items():
        if m.float8_weight is not None:
            m.register_forward_pre_hook(lambda m, args, name=name: keep(m, args, name))
    with mock.patch.object(zero_gather, "all_gather", counting):
        run_step(steps[1], cfg.memory.precision, cfg.optim.lr)
    exact = True
    for name, (data, scale) in seen.items():
        ref = hp_tensor_to_float8_dynamic(whole[name].to(engine.compute_dtype), compat.FLOAT8_E4M3,
                                          linears[name].gemm.mm_config)
        exact &= torch.equal(data.view(torch.uint8), ref._data.view(torch.uint8)) and torch.equal(scale, ref._scale)
    per_block = {}
    for name, m in linears.items():
        block = name.rsplit(".", 3)[0]  # layers.<i>
        per_block[block] = per_block.get(block, 0) + m.weight.numel()
    return {"bytes": bytes_by_dtype, "seen": len(seen), "linears": len(linears), "exact": exact,
            "shard_bytes": sum(math.ceil(n / world) for n in per_block.values()), "micro": len(steps[1])}


def _each_gathers(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [_gathers(rank, world, layout) for layout in layouts]


@pytest.mark.parametrize("masters", MASTERS)
def test_float8_gather_moves_one_byte_per_element(masters):
    """Each float8 weight moves 1 byte an element: the uint8 gathers' input bytes are the float8 weights'
    shards, once before each micro-batch's forward and once before its backward; and what a float8
    linear multiplies by is exactly one process's float8 cast of its weight. With memory.fp8_gather=
    false nothing is gathered in 1 byte."""
    layouts = [masters + ["parallel.zero=3"], masters + ["parallel.zero=3", "memory.fp8_gather=false"]]
    on, off = run_ranks(_each_gathers, 2, layouts)[0]
    assert on["linears"] > 0 and on["seen"] == on["linears"] and on["exact"], on
    assert on["bytes"]["torch.uint8"] == 2 * on["micro"] * on["shard_bytes"], on
    assert "torch.uint8" not in off["bytes"] and off["seen"] == 0, off
    wide = 4 if masters == ["memory.master_weights=false"] else 2  # the compute dtype's bytes
    assert sum(off["bytes"].values()) - sum(on["bytes"].values()) == 2 * on["micro"] * on["shard_bytes"] * (wide - 1)
