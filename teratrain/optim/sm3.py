"""SM3 (Anil, Gupta, Koren, Singer 2019, "Memory-Efficient Adaptive Optimization"), the SM3-II variant.

Adagrad keeps one second-moment sum per parameter entry. SM3 keeps one accumulator per *cover set*
and bounds each entry's sum by the smallest accumulator covering it. Our cover sets are the rows and
the columns of a matrix, so a (m, n) matrix keeps m + n numbers instead of m*n; a vector is its own
cover (one set per entry: exactly diagonal Adagrad). SM3-II, per step t (paper, Algorithm SM3-II):

    nu_t(i)    = min over sets S_r containing i of mu_{t-1}(r)  +  g_t(i)^2
    w_{t+1}(i) = w_t(i) - lr * g_t(i) / sqrt(nu_t(i))
    mu_t(r)    = max over j in S_r of nu_t(j)

For a matrix: nu = min(row_acc[:, None], col_acc[None, :]) + g^2, then row_acc = nu.max(1),
col_acc = nu.max(0). nu >= g^2, so |g / sqrt(nu)| <= 1: no epsilon is needed (0/0 is taken as 0).
A tensor of more dimensions is a stack of matrices (an MoE layer's experts, models/moe.py `Experts`):
each matrix keeps its own rows and columns, accumulators of shapes (*stack, m) and (*stack, n), as the
matrices would apart. A stack of the experts' biases (experts, out) is covered as a matrix: a coarser
cover than each bias alone (which would keep one accumulator an entry), still a valid SM3 cover.

Momentum (optim.momentum, shared with SGD; 0 turns it off and drops the buffer), as in the authors'
implementation (google-research/sm3): m_t = beta*m_{t-1} + (1 - beta) * g_t/sqrt(nu_t), w -= lr * m_t.
Weight decay is decoupled as in AdamW: w <- w * (1 - lr*wd) before the update.

State per parameter: `acc_0` and `acc_1` (rows and columns; `acc_0` alone is the whole diagonal for a
vector or scalar) and `momentum_buffer` when momentum > 0. Created eagerly, fp32.
"""

from __future__ import annotations

import torch


class SM3(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"invalid SM3 hyperparameters lr={lr} momentum={momentum} weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = init_sm3_state(p, group["momentum"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # a parameter added after construction (add_param_group)
                    state.update(init_sm3_state(p, beta))
                update = _sm3_update(p.grad.float(), state)
                if beta > 0:
                    buf = state["momentum_buffer"]
                    buf.mul_(beta).add_(update, alpha=1 - beta)
                    update = buf
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
        return loss


def init_sm3_state(p: torch.Tensor, momentum: float) -> dict[str, torch.Tensor]:
    """Zero accumulators: one per index of every dimension (a vector or scalar: one per entry)."""
    if p.dim() <= 1:
        state = {"acc_0": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}
    else:  # a matrix, or a stack of them: rows and columns of each
        kw = {"dtype": torch.float32, "device": p.device}
        state = {"acc_0": torch.zeros(p.shape[:-1], **kw), "acc_1": torch.zeros((*p.shape[:-2], p.shape[-1]), **kw)}
    if momentum > 0:
        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
    return state


def _sm3_update(g: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """g / sqrt(nu_t) with nu_t from the accumulators; updates the accumulators to mu_t."""
    if g.dim() <= 1:
        nu = state["acc_0"].add_(g * g)  # one set per entry: mu = nu (diagonal Adagrad)
    else:  # min over the row and the column covering each entry, then each set's max
        nu = torch.minimum(state["acc_0"].unsqueeze(-1), state["acc_1"].unsqueeze(-2)) + g * g
        state["acc_0"].copy_(nu.amax(dim=-1))
        state["acc_1"].copy_(nu.amax(dim=-2))
    return torch.where(nu > 0, g * nu.rsqrt(), torch.zeros_like(g))
