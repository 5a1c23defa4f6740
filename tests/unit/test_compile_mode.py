"""train.compile_mode and train.compile_scope: their refusals, what each scope compiles, and the
engine's gradient buffers under CUDA graph replays (reduce-overhead), which hand back each backward's
gradients in the graph's own memory. A GPU is needed for real graphs (bench/tensor_parallel.py
--compile reduce-overhead checks their losses); here a backward that returns one reused buffer, as a
replay does, stands in for them."""

import pytest
import torch
from torch import nn

from teratrain.config import ConfigError
from teratrain.optim.engine import LocalEngine, train_step
from teratrain.parallel.parallelize import compile_scope, compile_units
from teratrain.parallel.support import check_supported
from tests.helpers import make_config, small_model


def test_a_mode_without_compile_is_refused():
    with pytest.raises(ConfigError, match="train.compile=true"):
        make_config("train.compile_mode=reduce-overhead")


@pytest.mark.parametrize("keys, fix", [(("parallel.pp=2", "model.n_layers=2"), "parallel.pp=1"),
                                       (("parallel.dp=2", "parallel.sync=local-sgd"), "parallel.sync=allreduce")])
def test_graphs_with_a_pipeline_or_another_sync_are_refused(keys, fix):
    cfg = make_config("train.compile=true", "train.compile_mode=reduce-overhead", "train.global_batch=4",
                      "train.micro_batch=2", *keys)
    with pytest.raises(ConfigError, match=fix):
        check_supported(cfg)


class _Replayed(torch.autograd.Function):
    """y = w; its backward writes the gradient into one buffer it reuses and returns a fresh tensor
    over that memory, as a CUDA graph replay returns its outputs."""
    pool: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        _Replayed.pool.copy_(g)
        return _Replayed.pool.detach()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x, y):
        return ((_Replayed.apply(self.w) - y) ** 2 * x).sum()


def _train(graphed: bool) -> list[float]:
    torch.manual_seed(0)
    model = _Model()
    _Replayed.pool = torch.empty(4)
    cfg = make_config("optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0.0", "train.grad_clip=0")
    engine = LocalEngine(model, cfg.optim, cfg.memory, 0.0, False, graphed=graphed)
    micro = [(torch.rand(4), torch.rand(4)) for _ in range(3)]
    for _ in range(2):
        train_step(model, engine, micro, "fp32", 0.1)
    return model.w.detach().tolist()


def _reference() -> list[float]:
    """The same two steps by hand: SGD on the mean of the three micro-batches' gradients."""
    torch.manual_seed(0)
    micro = [(torch.rand(4), torch.rand(4)) for _ in range(3)]
    w = torch.zeros(4)
    for _ in range(2):
        grad = sum(2 * (w - y) * x for x, y in micro) / 3
        w = w - 0.1 * grad
    return w.tolist()


def test_graphed_engine_accumulates_replayed_gradients():
    assert _train(graphed=True) == pytest.approx(_reference(), abs=1e-6)


def test_without_its_own_buffers_a_replay_overwrites_the_accumulated_gradient():
    """The failure the graphed engine exists for (pytorch#169545): autograd adopts the first
    micro-batch's replayed gradient as .grad, and the next replay overwrites it before it is added to."""
    assert _train(graphed=False) != pytest.approx(_reference(), abs=1e-3)


def test_compile_overlap_needs_compile_and_sets_inductor_for_the_next_compile():
    """train.compile_overlap is a setting of compiled code: refused alone; parallelize() states it to
    inductor (process-wide) before each compile, on and off."""
    import torch._inductor.config as inductor

    from teratrain import compat

    with pytest.raises(ConfigError, match="train.compile_overlap"):
        make_config("train.compile_overlap=true")
    make_config("train.compile=true", "train.compile_overlap=true")
    try:
        passes = compat.compile_comm_overlap(True)
        assert passes and set(passes) <= set(compat.OVERLAP_PASSES)
        assert inductor.reorder_for_compute_comm_overlap and inductor.reorder_for_compute_comm_overlap_passes == passes
    finally:
        assert compat.compile_comm_overlap(False) == []
    assert not inductor.reorder_for_compute_comm_overlap and inductor.reorder_for_compute_comm_overlap_passes == []


@pytest.mark.parametrize("sets, dp, scope", [
    ([], 2, "block"),  # gradients reduced from backward hooks: each block its own graph
    ([], 1, "model"),  # nothing to reduce: one graph
    (["parallel.overlap_comm=false"], 2, "model"),  # reductions wait for the backward anyway
    (["memory.recompute=full"], 2, "model"),  # checkpointed segments around the blocks
    (["memory.recompute=selective"], 2, "block"),  # inside each block
    (["train.compile_mode=reduce-overhead"], 2, "model"),  # one CUDA graph of the step
    (["parallel.sync=local-sgd", "parallel.sync_every=4"], 2, "model"),  # no per-step reduction
    (["train.compile_scope=model"], 2, "model"),
    (["train.compile_scope=block"], 1, "block"),
    (["parallel.zero=3"], 1, "block"),  # its hooks are on the blocks: always each block apart
])
def test_compile_scope_auto_compiles_blocks_apart_where_backward_reduces(sets, dp, scope):
    assert compile_scope(make_config("train.compile=true", *sets), dp) == scope


def test_compile_units_of_each_scope():
    """Scope block: every block, the final norm and the losses, plain and chunked (the decoder's eager
    rest is the embeddings and the plain path's output projection); model: the model; a pipeline stage: its blocks."""
    model = small_model(n_layers=3)
    block = compile_units(model, False, make_config("train.compile=true"), dp=2)
    assert block == [*model.layers, model.norm, model.criterion, model.chunked_loss]
    assert compile_units(model, False, make_config("train.compile=true"), dp=1) == [model]
    assert compile_units(model, True, make_config("train.compile=true"), dp=1) == list(model.layers)
    blockless = nn.Sequential(nn.Linear(4, 4))  # a model of your own with no blocks to find
    assert compile_units(blockless, False, make_config("train.compile=true"), dp=2) == [blockless]
    with pytest.raises(ConfigError, match="has no blocks"):
        compile_units(blockless, False, make_config("train.compile=true", "train.compile_scope=block"), dp=2)


@pytest.mark.parametrize("sets, why", [
    (["train.compile_scope=block"], "train.compile=true"),
    (["train.compile=true", "train.compile_scope=block", "train.compile_mode=reduce-overhead"], "CUDA graph"),
    (["train.compile=true", "train.compile_scope=block", "memory.recompute=sqrt"], "memory.recompute=sqrt"),
    (["train.compile=true", "parallel.zero=3", "train.compile_scope=model"], "gather and free hooks"),
    (["train.compile=true", "parallel.zero=3", "memory.recompute=full"], "parallel.zero=3"),
    (["train.compile=true", "parallel.zero=3", "train.compile_mode=reduce-overhead"], "parallel.zero=3"),
])
def test_compile_scope_refusals_name_the_fix(sets, why):
    with pytest.raises(ConfigError, match=why):
        make_config(*sets)


def test_the_start_up_summary_says_what_is_compiled():
    from types import SimpleNamespace

    from teratrain.startup import _compiled

    dims = lambda dp, pp=1: SimpleNamespace(dp=dp, pp=pp, replicas=dp)  # noqa: E731
    assert _compiled(make_config(), dims(2)) == ""
    assert _compiled(make_config("train.compile=true"), dims(2)) == ", compiled (each block)"
    assert _compiled(make_config("train.compile=true"), dims(1)) == ", compiled (the whole model)"
    assert _compiled(make_config("train.compile=true", "train.compile_mode=reduce-overhead"),
                     dims(1)) == ", compiled (the whole model, CUDA graphs)"


def test_a_layout_tried_by_the_planner_is_checked_for_compiled_zero3():
    """parallel.auto sets a candidate's keys on a copy of the config and asks check_supported: ZeRO-3
    with a replaying recompute policy under train.compile is refused there too."""
    cfg = make_config("train.compile=true")
    cfg.parallel.zero, cfg.memory.recompute = 3, "full"
    with pytest.raises(ConfigError, match="parallel.zero=3"):
        check_supported(cfg)


def test_fold_reshapes_hands_the_gathered_rows_to_the_gemms():
    """compat._fold_reshapes (the post-grad pass parallel.tp_overlap=async adds): a (rows, d) tensor
    viewed (B, T, d) for the block and back to rows by a linear reaches the GEMM directly, as
    inductor's async-TP pass needs it; a reshape that lands elsewhere keeps one reshape of the source,
    and the values do not change."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from teratrain.compat import _fold_reshapes

    def block(rows, w):
        x = rows.view(2, 16, 32)  # what the sequence gather hands the block
        return x.reshape(32, 32) @ w, x.view(2, 512).sum(1)  # a linear's rows; another shape

    rows, w = torch.randn(32, 32), torch.randn(32, 8)
    gm = make_fx(block, tracing_mode="fake")(rows, w)
    _fold_reshapes(gm.graph)
    gm.recompile()
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    assert mm.args[0].op == "placeholder", gm.code  # the rows themselves
    other = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList).args[0]
    assert other.target == torch.ops.aten.reshape.default and other.args[0].op == "placeholder", gm.code
    for got, want in zip(gm(rows, w), block(rows, w)):
        torch.testing.assert_close(got, want)


def test_async_tp_keeps_a_post_grad_pass_the_user_set():
    """parallel.tp_overlap=async needs inductor's post_grad_custom_pre_pass for its reshape folding; one
    the process set already is neither replaced nor silently left to stop the fusion: one sentence."""
    import torch._inductor.config as inductor

    from teratrain import compat
    from teratrain.config import ConfigError

    theirs = inductor.post_grad_custom_pre_pass = lambda graph: None
    try:
        with pytest.raises(ConfigError, match="post_grad_custom_pre_pass"):
            compat.compile_async_tp(object())
        assert inductor.post_grad_custom_pre_pass is theirs and not inductor._micro_pipeline_tp
        assert not compat.compile_async_tp(None) and inductor.post_grad_custom_pre_pass is theirs
    finally:
        inductor.post_grad_custom_pre_pass = None
