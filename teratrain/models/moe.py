"""Mixture-of-experts feed-forward layer: n experts, a router chosen by config, expert capacity.

Single-device code. The routed rows are laid out by expert on the device (models/permute.py) and
run as grouped GEMMs (models/grouped.py), with no read-back to the host. Expert parallelism
(parallel/expert.py) replaces only `MoE.exchange`, which takes each routed row to the rank that
holds its expert and brings the output back.

Routers (`model.moe.router`), each its paper's equations over the N tokens of one forward:
- softmax-topk (Mixtral, Jiang et al. 2024): p = softmax(x W_r), the k largest renormalized to sum 1;
  aux = n * sum_i f_i P_i with f_i the share of the N*k choices that picked expert i, P_i = mean_x p_i.
- noisy-topk (Shazeer et al. 2017, sec. 2.1, 4, appendix A): H = x W_g + eps * Softplus(x W_noise),
  eps ~ N(0, noise^2), G = Softmax(KeepTopK(H, k)); aux = CV(Importance)^2 + CV(Load)^2 with
  Importance = sum_x G(x) and the smooth Load_i = sum_x Phi(((x W_g)_i - kth_excluding(H, k, i)) /
  Softplus((x W_noise)_i)). W_g, W_noise start at zero. Noise (and the smooth load) in training only.
- gshard-top2 (Lepikhin et al. 2020, Algorithm 1): g = softmax(x W_g); top-2, g1 and g2 divided by
  g1 + g2; in training the second expert is used with probability min(1, 2 g2) (random routing);
  aux = (1/E) sum_e (c_e / S) m_e per local group of S tokens (c_e: tokens whose first choice is e,
  m_e: mean gate), averaged over the groups.
- switch-top1 (Fedus et al. 2021, sec. 2.1-2.4): the top-1 expert of p = softmax(x W_r), output scaled
  by p_i; aux = n * sum_i f_i P_i; router in fp32; init std sqrt(s / d_model) with s = 0.1.
- hierarchical (Shazeer et al. 2017, appendix B): a noisy top-k gate over a groups and, in each group,
  a noisy top-k gate over its b experts: y = sum_i sum_j G_p(x)_i G_i(x)_j E_ij(x) (eq. 12), aux =
  CV(Importance_H)^2 + CV(Load_H)^2 (eqs. 13-14). Expert e = i * b + j.
Every aux loss is multiplied by `aux_loss_weight` and the layers' losses are summed. CV^2 is the
population variance over the squared mean. `aux_loss_convention = "transformers"` (softmax-topk) takes
transformers' Mixtral loss instead: n * sum_e (c_e / T)(S_e / T) with c_e the choices of expert e, S_e
its summed softmax and T the tokens, all pooled over the layers (per layer: k times ours).

Capacity (GShard sec. 2.2, Switch sec. 2.2): the N tokens are split into `groups` contiguous local
groups; of a group of S tokens an expert takes at most C = ceil(capacity_factor * K * S / n) of the K
choices per token, first choices before second ones, then in token order (GShard's Algorithm 1). A
dropped choice is not sent to its expert: its output is zero and the token passes through the
residual connection. Drops are counted (`pop_stats`).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.compat import in_backward
from teratrain.models.grouped import compute_dtype, row_align, run_experts, stack_experts, use_grouped
from teratrain.models.permute import Layout, combine, dispatch, grouped_layout

if TYPE_CHECKING:
    from teratrain.config_model import ModelConfig, MoEConfig

SWITCH_INIT_SCALE = 0.1  # Fedus et al. 2021, sec. 2.4: a tenth of the usual 1.0


@dataclass
class Routing:
    experts: torch.Tensor  # (N, K) long: global expert of each choice, the most important choice first
    weights: torch.Tensor  # (N, K) combine weight of each choice (used where `routed`)
    routed: torch.Tensor  # (N, K) bool: sent to its expert (within capacity; GShard: and sampled)
    aux_loss: torch.Tensor  # () weighted auxiliary loss
    attempted: torch.Tensor  # () choices that asked for their expert (before the capacity cut)
    probs: torch.Tensor | None = None  # (N, n) the softmax over all experts (softmax-topk, switch-top1)


def cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation, population variance / mean^2 (Shazeer et al. 2017, eq. 6)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


def within_capacity(experts: torch.Tensor, routed: torch.Tensor, num_experts: int, factor: float,
                    groups: int) -> torch.Tensor:
    """(N, K) bool: the routed choices that fit their expert's capacity in their local group."""
    if factor <= 0:
        return routed
    N, K = experts.shape
    keep = torch.zeros_like(routed)
    for lo, hi in _group_bounds(N, groups):
        S = hi - lo
        cap = math.ceil(factor * K * S / num_experts)
        e, r = experts[lo:hi].t(), routed[lo:hi].t()  # (K, S): choice-major, then token order
        # choices of each expert so far, this one included: a scan along each expert's row (a scan over
        # the K*S rows of a few columns is a slow kernel on GPUs: 22% of an MoE step)
        mine = (torch.arange(num_experts, device=e.device)[:, None] == e.reshape(1, -1)) & r.reshape(1, -1)
        seen = mine.cumsum(1, dtype=torch.int32)  # (n, K*S)
        position = seen.gather(0, e.reshape(1, -1)).view(K, S) - 1  # (K, S): slot in the expert's buffer
        keep[lo:hi] = (r & (position < cap)).t()
    return keep


def capacity_rows(num_tokens: int, k: int, num_experts: int, factor: float, groups: int) -> int | None:
    """The most rows one expert can take from N tokens (its capacity summed over the local groups, at
    most one row per token), or None without a capacity limit. Known on the host: the size of a
    padded exchange's slots (parallel/expert.py)."""
    if factor <= 0:
        return None
    total = sum(math.ceil(factor * k * (hi - lo) / num_experts) for lo, hi in _group_bounds(num_tokens, groups))
    return min(total, num_tokens)


def _group_bounds(n: int, groups: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) of `groups` near-equal groups of n tokens (the first ones one longer)."""
    size, extra = divmod(n, groups)
    bounds, lo = [], 0
    for g in range(groups):
        hi = lo + size + (g < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


# ---------------------------------------------------------------- routers

def router_rows(cfg: "MoEConfig") -> int:
    """Rows of the router's matrices: one per expert (hierarchical: per group, then per expert)."""
    return cfg.num_experts + (cfg.num_groups if cfg.router == "hierarchical" else 0)


def router_param_names(cfg: "MoEConfig") -> list[str]:
    """The router's parameters, each (router_rows, d_model): W_g, plus W_noise for noisy gates."""
    return ["weight", "w_noise"] if cfg.router in ("noisy-topk", "hierarchical") else ["weight"]


class Router(nn.Module, abc.ABC):
    """x (N, d) -> Routing. Subclasses implement `gate`; capacity and the aux weight are applied here."""

    def __init__(self, cfg: "MoEConfig", d_model: int):
        super().__init__()
        self.n, self.k, self.fp32 = cfg.num_experts, cfg.k, cfg.router_dtype == "fp32"
        self.capacity, self.groups, self.aux_weight = cfg.capacity, cfg.num_groups, cfg.aux_loss_weight
        self.noise, self.z_weight = cfg.noise_scale, cfg.z_loss_weight
        for name in router_param_names(cfg):
            setattr(self, name, nn.Parameter(torch.empty(router_rows(cfg), d_model)))

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None, seq_len: int | None = None) -> Routing:
        """x (N, d), the tokens of N / seq_len sequences one after another."""
        experts, weights, routed, aux, probs, logits = self.gate(x, gen, seq_len or x.shape[0])
        kept = within_capacity(experts, routed, self.n, self.capacity, self.capacity_groups)
        loss = self.aux_weight * aux
        if self.z_weight:
            loss = loss + self.z_weight * z_loss(logits)
        return Routing(experts, weights, kept, loss, routed.sum(), probs)

    def max_rows(self, num_tokens: int, k: int) -> int | None:
        """Rows one expert takes at most from `num_tokens` tokens of k choices (None: no limit)."""
        return capacity_rows(num_tokens, k, self.n, self.capacity, self.capacity_groups)

    @property
    def capacity_groups(self) -> int:
        return self.groups

    def logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x W^T: in fp32 with autocast off (Switch's selective precision), or in the compute dtype."""
        if not self.fp32:
            return F.linear(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), w.float())  # (N, rows)

    @abc.abstractmethod
    def gate(self, x: torch.Tensor, gen: torch.Generator | None, seq_len: int):
        """(experts (N, K), weights (N, K), routed (N, K) bool before capacity, unweighted aux loss,
        the softmax over all experts (N, n) or None for routers without one, the logits (N, n) of
        one row per expert that the z-loss reads)."""


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).square().mean()


class SoftmaxTopK(Router):
    """Top-k of per-expert scores s = softmax(x W_r) or sigmoid(x W_r) (model.moe.score). balance=bias
    (DeepSeek-V3 sec. 2.1.2): the k largest s_e + b_e are chosen, their gates come from s alone; b is a
    buffer moved by `update_bias` after every optimizer step, never by the optimizer."""

    def __init__(self, cfg: "MoEConfig", d_model: int):
        super().__init__(cfg, d_model)
        self.sigmoid, self.norm, self.bias_rate = cfg.score == "sigmoid", cfg.normalize_topk, cfg.bias_rate
        self.sequence = cfg.aux_loss_kind == "sequence"
        self.register_buffer("expert_bias", torch.zeros(self.n) if cfg.balance == "bias" else None)

    def gate(self, x, gen, seq_len):
        logits = self.logits(x, self.weight)  # (N, n)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        if self.expert_bias is None:
            top, experts = scores.topk(self.k, dim=-1)  # (N, k)
        else:  # the choice by s + b, the gates from s (a gather: distinct indices per row)
            experts = (scores.detach() + self.expert_bias).topk(self.k, dim=-1).indices
            top = scores.gather(1, experts)
        weights = top / top.sum(-1, keepdim=True) if self.norm else top
        normed = scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores  # a softmax already sums to 1
        aux = balance_loss(normed, experts, self.n, seq_len if self.sequence else x.shape[0])
        probs = None if self.sigmoid else scores
        return experts, weights, torch.ones_like(experts, dtype=torch.bool), aux, probs, logits

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """b_e += bias_rate * sign(mean load - load_e) (DeepSeek-V3 sec. 2.1.2), `load` (n,) the routed
        tokens of each expert over the whole global batch of the step (the same on every rank)."""
        load = load.to(self.expert_bias.device, torch.float64)
        self.expert_bias += (self.bias_rate * torch.sign(load.mean() - load)).to(self.expert_bias.dtype)


def balance_loss(scores: torch.Tensor, experts: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """n * sum_e f_e P_e per run of seq_len tokens, averaged over the runs: f_e the share of the run's
    T*k choices that picked e, P_e the run's mean of `scores` (N, n), each row summing to 1. One run
    of all N tokens: Switch eq. 4 / Mixtral; runs of one sequence: DeepSeek-V3's sequence-wise loss
    (eq. 17-20: its f_e = n / (k T) * count_e is n times the share here, its loss sum_e f_e P_e)."""
    N, k = experts.shape
    if seq_len >= N:
        f = F.one_hot(experts, n).sum((0, 1)).to(scores.dtype) / experts.numel()  # share of the N*k choices
        return n * (f * scores.mean(0)).sum()
    runs = N // seq_len
    f = F.one_hot(experts.view(runs, seq_len * k), n).sum(1).to(scores.dtype) / (seq_len * k)  # (runs, n)
    return (n * (f * scores.view(runs, seq_len, n).mean(1)).sum(-1)).mean()


class SwitchTop1(Router):
    def gate(self, x, gen, seq_len):
        logits = self.logits(x, self.weight)
        probs = logits.softmax(-1)  # (N, n)
        p, expert = probs.max(-1)  # (N,)
        f = F.one_hot(expert, self.n).to(probs.dtype).mean(0)  # fraction of tokens dispatched to each expert
        aux = self.n * (f * probs.mean(0)).sum()  # Fedus et al. eq. 4 (times alpha = aux_loss_weight)
        experts = expert.unsqueeze(1)
        return experts, p.unsqueeze(1), torch.ones_like(experts, dtype=torch.bool), aux, probs, logits


class GShardTop2(Router):
    def gate(self, x, gen, seq_len):
        logits = self.logits(x, self.weight)
        gates = logits.softmax(-1)  # (N, E)
        top, experts = gates.topk(2, dim=-1)
        weights = top / top.sum(-1, keepdim=True)  # g1, g2 normalized
        routed = torch.ones_like(experts, dtype=torch.bool)
        if self.training:  # random routing: the second expert with probability 2 * g2
            rnd = torch.rand(x.shape[0], device=x.device, generator=gen, dtype=weights.dtype)
            routed[:, 1] = rnd < 2 * weights[:, 1].detach()
        aux = []
        for lo, hi in _group_bounds(x.shape[0], self.groups):
            c = F.one_hot(experts[lo:hi, 0], self.n).to(gates.dtype).sum(0)  # tokens whose first choice is e
            m = gates[lo:hi].mean(0)
            aux.append((c / (hi - lo) * m).sum() / self.n)
        return experts, weights, routed, torch.stack(aux).mean(), None, logits


def _noisy_topk(clean: torch.Tensor, noise_logits: torch.Tensor, k: int, scale: float, noisy: bool,
                gen: torch.Generator | None):
    """Shazeer et al.'s noisy top-k gate over the last dim (any leading dims). Returns the chosen
    indices (.., k), their gates (.., k), the dense gates G (.., n) and each entry's contribution to
    Load: Pr(still in the top k under new noise) (eq. 9-10) in training, else 1 if chosen."""
    n = clean.shape[-1]
    std = F.softplus(noise_logits) * scale
    noisy = noisy and scale > 0
    h = clean + torch.randn(clean.shape, device=clean.device, dtype=clean.dtype, generator=gen) * std if noisy else clean
    top, idx = h.topk(min(k + 1, n), dim=-1)
    gates = top[..., :k].softmax(-1)  # Softmax(KeepTopK(H, k)) restricted to the kept entries
    dense = torch.zeros_like(clean).scatter(-1, idx[..., :k], gates)
    if not noisy or k >= n:
        return idx[..., :k], gates, dense, (dense > 0).to(clean.dtype)
    # kth_excluding(H, k, i): the (k+1)-th value for an entry inside the top k, else the k-th
    inside = h > top[..., k:k + 1]
    threshold = torch.where(inside, top[..., k:k + 1], top[..., k - 1:k])
    load = torch.special.ndtr((clean - threshold) / std)
    return idx[..., :k], gates, dense, load


class NoisyTopK(Router):
    def gate(self, x, gen, seq_len):
        clean, noise = self.logits(x, self.weight), self.logits(x, self.w_noise)  # (N, n) each
        experts, weights, dense, load = _noisy_topk(clean, noise, self.k, self.noise, self.training, gen)
        aux = cv_squared(dense.sum(0)) + cv_squared(load.sum(0))  # importance, load (eqs. 6-11)
        return experts, weights, torch.ones_like(experts, dtype=torch.bool), aux, None, clean


class Hierarchical(Router):
    """Rows [0, a) of W_g / W_noise gate the a groups; rows a + i*b .. a + (i+1)*b gate group i's b experts."""

    def __init__(self, cfg: "MoEConfig", d_model: int):
        super().__init__(cfg, d_model)
        self.a = cfg.num_groups
        self.b = self.n // self.a

    @property
    def capacity_groups(self) -> int:
        return 1  # `groups` are the expert groups here

    def gate(self, x, gen, seq_len):
        N, a, b, k = x.shape[0], self.a, self.b, self.k
        clean, noise = self.logits(x, self.weight), self.logits(x, self.w_noise)  # (N, a + n)
        gi, gp, Gp, load_p = _noisy_topk(clean[:, :a], noise[:, :a], k, self.noise, self.training, gen)  # (N, k)
        gj, gs, Gs, load_s = _noisy_topk(clean[:, a:].view(N, a, b), noise[:, a:].view(N, a, b), k, self.noise,
                                         self.training, gen)  # every group's secondary gate: (N, a, k), (N, a, b)
        pick = gi.unsqueeze(-1).expand(N, k, k)  # [x, p, q] -> the q-th choice inside group gi[x, p]
        experts = (gi.unsqueeze(-1) * b + gj.gather(1, pick)).flatten(1)  # (N, k*k), primary choice major
        weights = (gp.unsqueeze(-1) * gs.gather(1, pick)).flatten(1)
        importance = (Gp.unsqueeze(-1) * Gs).sum(0)  # (a, b), eq. 13
        member = (Gp > 0).to(load_s.dtype)  # (N, a): x in X^(i)
        load = load_p.sum(0).unsqueeze(-1) * (member.unsqueeze(-1) * load_s).sum(0) / member.sum(0).clamp(min=1).unsqueeze(-1)  # eq. 14
        aux = cv_squared(importance.flatten()) + cv_squared(load.flatten())
        return experts, weights, torch.ones_like(experts, dtype=torch.bool), aux, None, None


ROUTERS = {"softmax-topk": SoftmaxTopK, "noisy-topk": NoisyTopK, "gshard-top2": GShardTop2,
           "switch-top1": SwitchTop1, "hierarchical": Hierarchical}


@torch.no_grad()
def init_router_(t: torch.Tensor, cfg: "ModelConfig", gen: torch.Generator) -> None:
    """Router init by paper: Shazeer's W_g and W_noise start at zero (appendix A); Switch's router
    draws from a normal truncated at 2 std with std sqrt(0.1 / d_model) (sec. 2.4); others N(0, init_std)."""
    router = cfg.moe.router
    if router in ("noisy-topk", "hierarchical"):
        t.zero_()
    elif router == "switch-top1":
        std = math.sqrt(SWITCH_INIT_SCALE / cfg.d_model)
        t.normal_(0.0, std, generator=gen).clamp_(-2 * std, 2 * std)
    else:
        t.normal_(0.0, cfg.init_std, generator=gen)


# ---------------------------------------------------------------- experts and the layer

class Expert(nn.Module):
    """One expert: the block's MLP, SwiGLU w2(silu(w1 x) * w3 x) (llama) or GELU w2(gelu(w1 x)) (gpt2),
    with dropout on its hidden activations (Switch's expert dropout, sec. 2.4)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, dropout: float, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x)) * self.w3(x) if self.w3 is not None else F.gelu(self.w1(x), approximate="tanh")
        return self.w2(self.dropout(h))


class MoE(nn.Module):
    """The feed-forward layer of an MoE block: (B, T, d) -> (B, T, d). Experts live in a ModuleDict
    keyed by global expert index, so expert parallelism keeps only its own without renaming any.

    Dispatch: each of the N*K choices has a key, its expert or n when it is not sent; the rows are
    laid out by expert on the device by a permutation whose forward and backward are gathers
    (models/permute.py), the experts run as one grouped GEMM per weight (or one by one: `kernel`;
    models/grouped.py), and the outputs are gathered back, weighted and summed per token; no device
    value is read back to the host."""

    def __init__(self, cfg: "ModelConfig", layer: int):
        super().__init__()
        m = cfg.moe
        self.num_experts, self.layer = m.num_experts, layer
        self.router = ROUTERS[m.router](m, cfg.d_model)
        drop = cfg.dropout if m.expert_dropout is None else m.expert_dropout
        self.experts = nn.ModuleDict({str(e): Expert(cfg.d_model, cfg.expert_ffn_dim, cfg.use_bias, drop,
                                                     cfg.arch == "llama") for e in range(m.num_experts)})
        # shared experts (DeepSeek-MoE): one MLP as wide as all of them together, which is their sum
        self.shared_expert = Expert(cfg.d_model, cfg.shared_ffn_dim, cfg.use_bias, drop, cfg.arch == "llama") \
            if m.shared_experts else None
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if m.shared_gate else None  # Qwen2-MoE
        self.dropout = nn.Dropout(cfg.dropout)
        self.convention, self.aux_weight = m.aux_loss_convention, m.aux_loss_weight
        self.kernel = "auto"  # grouped GEMM where it runs without a read-back; "grouped" / "loop" force one
        self.exchange = None  # expert parallelism: (flat, key, k, max_rows, moe) -> (outputs, layout); None: all here
        self.routing_seed: int | None = None  # draw router noise from a generator seeded per forward (seed_routing)
        self.aux_loss: torch.Tensor | None = None  # of the latest forward; the model adds it to the loss
        self.balance: tuple | None = None  # transformers convention: (choices (n,), summed softmax (n,), tokens)
        self.stats: dict[str, torch.Tensor] = {}
        self.graphed = False  # replayed as a CUDA graph (start_stats says so): see settle_stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        r = self.router(flat, self._generator(x.device), x.shape[1] if x.dim() == 3 else None)
        N, K = r.experts.shape
        key = torch.where(r.routed, r.experts, self.num_experts).flatten()  # (N*K,) token-major; n: not sent
        if self.exchange is None:
            ys, lay = self.run_local(flat, key, K)
        else:
            ys, lay = self.exchange(flat, key, K, self.router.max_rows(N, K), self)
        w = torch.where(r.routed, r.weights, 0.0).to(ys.dtype)
        out = combine(ys, lay, w, K)  # (N, d); all choices dropped: zero
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(flat))
            out = out + shared.to(out.dtype)
        self._set_aux(r)
        self._record(r, lay.counts)
        return self.dropout(out.view(x.shape))

    def run_local(self, x: torch.Tensor, key: torch.Tensor, k: int = 1,
                  stacks: dict | None = None) -> tuple[torch.Tensor, Layout]:
        """This module's experts on rows of x: input row i (x[i // k]) goes to the key[i]-th of them,
        nowhere for key len(self.experts). Returns the experts' outputs laid out by the returned
        layout (models/permute.py: `combine` brings them back to the input rows). `stacks`: from
        `stacked`, shared by several calls of one forward."""
        experts = list(self.experts.values())
        grouped = use_grouped(experts, x, self.kernel)
        lay = grouped_layout(key, len(experts), row_align(grouped))
        return run_experts(experts, dispatch(x, lay, k, compute_dtype(x)), lay.offsets, grouped, stacks), lay

    def stacked(self, x: torch.Tensor) -> dict | None:
        """This module's expert weights stacked for the grouped GEMMs of run_local on rows like x (None
        where the experts run one by one): a chunked exchange runs the experts once per chunk."""
        experts = list(self.experts.values())
        return stack_experts(experts, compute_dtype(x)) if use_grouped(experts, x, self.kernel) else None

    def _set_aux(self, r: Routing) -> None:
        """The aux loss of this forward, by `model.moe.aux_loss_convention` (docs/moe.md, "Auxiliary loss:
        two conventions")."""
        if self.convention == "transformers":  # per layer n sum_e (choices_e / N) P_e; pooled over layers by aux_loss()
            choices = torch.zeros(self.num_experts, device=r.experts.device).scatter_add_(
                0, r.experts.flatten(), torch.ones(r.experts.numel(), device=r.experts.device))
            self.balance = (choices, r.probs.float().sum(0), r.experts.shape[0])
            self.aux_loss = _pooled_balance_loss([self], self.aux_weight)
        else:
            self.aux_loss = r.aux_loss

    def update_bias(self, load: torch.Tensor) -> None:
        """After an optimizer step: the router's expert bias (balance=bias) moved by the step's load (n,)
        over the whole global batch; other routers keep nothing to move."""
        if getattr(self.router, "expert_bias", None) is not None:
            self.router.update_bias(load)

    def scale_aux_grad(self, s: float) -> None:
        """Keep the aux loss's value but s times its gradient (tensor parallelism: every tp rank
        computes it whole, and the router's gradient is summed over tp)."""
        self.aux_loss = _grad_scaled(self.aux_loss, s)
        if self.balance is not None:
            c, p, n = self.balance
            self.balance = (c, _grad_scaled(p, s), n)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.routing_seed is None:
            return None  # the default generator (replayed by recomputation's preserve_rng_state)
        return torch.Generator(device=device).manual_seed(self.routing_seed * 1_000_003 + self.layer)

    @torch.no_grad()
    def _record(self, r: Routing, counts: torch.Tensor) -> None:
        """Accumulate the step's statistics (tensors on the device: no synchronization). Skipped in
        evaluation and when recomputation replays this forward inside backward."""
        if not self.training or (not torch.compiler.is_compiling() and in_backward()):
            return  # compiled: recomputation replays the traced graph, never this Python
        new = {"load": counts.double(), "dropped": (r.attempted - r.routed.sum()).double(),
               "attempted": r.attempted.double(), "aux_loss": self.aux_loss.detach().double(),
               "forwards": torch.ones((), dtype=torch.float64, device=counts.device)}
        for key, value in new.items():
            self.stats[key] = self.stats[key] + value if key in self.stats else value

    def start_stats(self, device: torch.device, graphed: bool = False) -> None:
        """Zero statistics on `device`, before the first forward (parallelize does it). From then on their
        keys and shapes stay the same (`pop_stats` resets them to zeros), so a compiled forward traces
        one graph, not one that creates them and one that adds to them. `graphed`: the forward replays
        as a CUDA graph (train.compile_mode=reduce-overhead), see `settle_stats`."""
        self.graphed = graphed
        kw = {"dtype": torch.float64, "device": device}
        self.stats = {"load": torch.zeros(self.num_experts, **kw),  # the keys in _record's order
                      **{key: torch.zeros((), **kw) for key in ("dropped", "attempted", "aux_loss", "forwards")}}

    def settle_stats(self) -> None:
        """A CUDA graph's replay (train.compile_mode=reduce-overhead) leaves the statistics it summed in
        the graph's memory pool, which the next step's replay overwrites while reading them as its
        inputs ("accessing tensor output of CUDAGraphs that has been overwritten"): copied out after each
        micro-batch (train_step), 5 small copies a layer. Eager and compiled without graphs: nothing."""
        if self.graphed:
            self.stats = {key: value.clone() for key, value in self.stats.items()}

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """This rank's statistics since the last call: load (n,) routed tokens per expert, dropped and
        attempted choices, summed aux loss and the forwards they came from; then reset to zeros of
        the same keys (empty stays empty)."""
        out, self.stats = self.stats, {key: torch.zeros_like(value) for key, value in self.stats.items()}
        return out


def _grad_scaled(t: torch.Tensor, s: float) -> torch.Tensor:
    """t's value with s times its gradient."""
    return t * s + (t * (1 - s)).detach()


def _pooled_balance_loss(layers: list["MoE"], weight: float) -> torch.Tensor:
    """transformers' Mixtral load_balancing_loss_func over these layers' latest forwards: the tokens of
    all layers pooled, n * sum_e (choices_e / T) (summed softmax_e / T) with T the pooled tokens, times
    `weight` (router_aux_loss_coef)."""
    choices = torch.stack([m.balance[0] for m in layers]).sum(0)
    probs = torch.stack([m.balance[1] for m in layers]).sum(0)
    tokens = sum(m.balance[2] for m in layers)
    return weight * layers[0].num_experts * (choices * probs).sum() / tokens ** 2


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(global layer key, MoE) of every MoE block this model holds; none for a model of the user's own
    (models/protocol.py), whose blocks are not teratrain's (a ModuleDict of blocks by global index)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        return []
    return [(key, block.feed_forward) for key, block in layers.items()
            if isinstance(getattr(block, "feed_forward", None), MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The MoE layers' weighted aux loss of the latest forward (None for a dense model): the sum of
    the layers' losses, or under the transformers convention one loss over all layers' tokens."""
    return blocks_aux_loss(model.layers.values())


def blocks_aux_loss(blocks) -> torch.Tensor | None:
    """The same over some blocks (a pipeline stage's), in order; None when none of them is MoE. The
    transformers convention pools every layer's tokens, so a pipeline refuses it (parallelize.py)."""
    layers = [b.feed_forward for b in blocks if isinstance(b.feed_forward, MoE) and b.feed_forward.aux_loss is not None]
    if not layers:
        return None
    if layers[0].convention == "transformers":
        return _pooled_balance_loss(layers, layers[0].aux_weight)
    return torch.stack([m.aux_loss.float() for m in layers]).sum()


def seed_routing(model: nn.Module, seed: int | None) -> None:
    """Draw every MoE layer's router randomness (noise, random routing) from generators seeded by
    (seed, layer) at each forward, instead of the default generator: any layout then routes a given
    micro-batch the same way. None returns to the default generator."""
    for _, m in moe_layers(model):
        m.routing_seed = seed


def expert_biases(model: nn.Module) -> dict[str, list[float]]:
    """{global layer key: expert bias} of this model's balance=bias routers (checkpointed in JSON)."""
    return {key: m.router.expert_bias.tolist() for key, m in moe_layers(model)
            if getattr(m.router, "expert_bias", None) is not None}


@torch.no_grad()
def load_expert_biases(model: nn.Module, saved: dict[str, list[float]]) -> None:
    """Restore the expert biases of `expert_biases` into this model's routers (layers it holds)."""
    for key, m in moe_layers(model):
        if getattr(m.router, "expert_bias", None) is not None and key in saved:
            m.router.expert_bias.copy_(torch.tensor(saved[key], dtype=torch.float64))


def count_moe_block(cfg: "ModelConfig", mlp: int) -> dict[str, int]:
    """Parameters of one MoE feed-forward layer given one routed expert's `mlp` count: total (router,
    every expert, the shared experts and their gate) and active (the matmul weights one token
    multiplies: the router, its experts, the shared ones)."""
    m, d = cfg.moe, cfg.d_model
    router = len(router_param_names(m)) * router_rows(m) * d
    shared = 0
    if m.shared_experts:
        n_mats, b = (3 if cfg.arch == "llama" else 2), (1 if cfg.use_bias else 0)
        shared = n_mats * d * cfg.shared_ffn_dim + b * ((n_mats - 1) * cfg.shared_ffn_dim + d) + d * m.shared_gate
    return {"total": router + shared + m.num_experts * mlp, "active": router + shared + m.experts_per_token * mlp}
