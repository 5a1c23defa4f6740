"""SM3 (optim/sm3.py) against a direct, written-out reference of the paper's SM3-II update: explicit
cover sets (index lists), nu(i) = min over the sets holding i of mu(r) + g(i)^2, w -= lr*g/sqrt(nu),
mu(r) = max over the set of nu, in float64 with Python loops over every entry; plus momentum and
decoupled weight decay as the module docstring states. Every accumulator, buffer and parameter is
compared after each of 6 steps (tolerance 1e-5 relative: the optimizer works in fp32)."""

import itertools
import math

import pytest
import torch

from teratrain.config import load_config
from teratrain.optim.build import build_optimizer
from teratrain.optim.engine import tensor_bytes
from teratrain.optim.sm3 import SM3

SHAPES = [(3, 4), (2, 3, 4), (5,), ()]


def cover_sets(shape: tuple) -> list[list[tuple]]:
    """SM3's cover: the rows, then the columns, of each matrix (rank > 2: a stack of matrices, each
    with its own, in the stack's order); a vector or scalar covers each entry by itself."""
    entries = list(itertools.product(*[range(n) for n in shape]))
    if len(shape) <= 1:
        return [[e] for e in entries]
    stacks = list(itertools.product(*[range(n) for n in shape[:-2]]))
    rows = [[e for e in entries if e[:-2] == s and e[-2] == k] for s in stacks for k in range(shape[-2])]
    cols = [[e for e in entries if e[:-2] == s and e[-1] == k] for s in stacks for k in range(shape[-1])]
    return rows + cols


class ReferenceSM3:
    """One parameter, float64, every entry and every set by hand."""

    def __init__(self, w: torch.Tensor, lr: float, beta: float, wd: float):
        self.w, self.lr, self.beta, self.wd = w.double().clone(), lr, beta, wd
        self.sets = cover_sets(tuple(w.shape))
        self.mu = [0.0] * len(self.sets)
        self.m = torch.zeros_like(self.w)

    def step(self, g: torch.Tensor) -> None:
        g = g.double()
        nu = {}
        for i in itertools.product(*[range(n) for n in self.w.shape]):
            nu[i] = min(self.mu[r] for r, s in enumerate(self.sets) if i in s) + float(g[i]) ** 2
        for r, s in enumerate(self.sets):
            self.mu[r] = max(nu[j] for j in s)
        update = torch.zeros_like(self.w)
        for i, v in nu.items():
            update[i] = float(g[i]) / math.sqrt(v) if v > 0 else 0.0
        if self.beta > 0:
            self.m = self.beta * self.m + (1 - self.beta) * update
            update = self.m
        self.w = self.w * (1 - self.lr * self.wd) - self.lr * update

    def accumulators(self) -> list[torch.Tensor]:
        """mu laid out as the optimizer keeps it: acc_0 the rows (*stack, m), acc_1 the columns (*stack, n)."""
        mu = torch.tensor(self.mu, dtype=torch.float64)
        if self.w.dim() <= 1:
            return [mu.reshape(self.w.shape)]
        *stack, m, n = self.w.shape
        rows = math.prod(stack) * m
        return [mu[:rows].reshape(*stack, m), mu[rows:].reshape(*stack, n)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta, wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.1)])
def test_sm3_matches_the_written_out_update(shape, beta, wd):
    torch.manual_seed(0)
    w = torch.randn(shape)
    p = torch.nn.Parameter(w.clone())
    opt = SM3([{"params": [p], "weight_decay": wd}], lr=0.1, momentum=beta)
    ref = ReferenceSM3(w, 0.1, beta, wd)
    for step in range(6):
        g = torch.randn(shape) * (0.1 if step % 2 else 2.0)  # changing scales exercise the min/max
        if len(shape) >= 2:
            g[0] = 0.0  # a zero row: its entries take the column bounds alone
        p.grad = g.clone()
        opt.step()
        ref.step(g)
        st = opt.state[p]
        for d, acc in enumerate(ref.accumulators()):
            assert _close(st[f"acc_{d}"], acc), (step, d)
        if beta > 0:
            assert _close(st["momentum_buffer"], ref.m), step
        assert _close(p.detach(), ref.w), step


def test_zero_gradient_entries_do_not_move():
    p = torch.nn.Parameter(torch.ones(2, 3))
    opt = SM3([p], lr=0.1, momentum=0.0)
    p.grad = torch.zeros(2, 3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 3))  # 0/sqrt(0) is taken as 0, never nan


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_state_is_rows_and_columns_times_4_bytes_plus_momentum(momentum):
    shapes = [(64, 48), (8, 6, 5), (100,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = SM3(params, lr=0.1, momentum=momentum)  # state exists before the first step
    tensors = [t for st in opt.state.values() for t in st.values()]
    expected = 4 * ((64 + 48) + 8 * (6 + 5) + 100)  # (8, 6, 5): 8 matrices of 6 rows and 5 columns
    if momentum:
        expected += 4 * sum(p.numel() for p in params)
    assert tensor_bytes(tensors) == expected


def test_built_from_config_with_decay_groups():
    cfg = load_config(None, ["optim.name=sm3", "optim.lr=0.05", "optim.momentum=0.5", "optim.weight_decay=0.1"])
    mat, vec = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    opt = build_optimizer([("w", mat), ("b", vec)], cfg.optim)
    assert isinstance(opt, SM3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # matrices only, as for AdamW
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["momentum"] == 0.5
