"""train.compile_mode: its refusals, and the engine's gradient buffers under CUDA graph replays
(reduce-overhead), which hand back each backward's gradients in the graph's own memory. A GPU is
needed for real graphs (bench/tensor_parallel.py --compile reduce-overhead checks their losses);
here a backward that returns one reused buffer, as a replay does, stands in for them."""

import pytest
import torch
from torch import nn

from teratrain.config import ConfigError
from teratrain.optim.engine import LocalEngine, train_step
from teratrain.parallel.parallelize import check_supported
from tests.helpers import make_config


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
