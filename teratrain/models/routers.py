"""Mixture-of-experts routers: x (N, d) -> Routing (the experts, gates and capacity of each token's
choices, the aux loss), one class per gating paper, chosen by `model.moe.router`. Single-device
code; the layer that runs the experts is models/moe.py.

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
Every aux loss is multiplied by `aux_loss_weight` and the layers' losses are summed (models/moe.py
also offers transformers' pooled convention). CV^2 is the population variance over the squared mean.

Capacity (GShard sec. 2.2, Switch sec. 2.2): the N tokens are split into `groups` contiguous local
groups; of a group of S tokens an expert takes at most C = ceil(capacity_factor * K * S / n) of the K
choices per token, first choices before second ones, then in token order (GShard's Algorithm 1). A
dropped choice is not sent to its expert (models/moe.py counts it).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from teratrain.config_model import ModelConfig, MoEConfig

SWITCH_INIT_SCALE = 0.1  # Fedus et al. 2021, sec. 2.4: a tenth of the usual 1.0


@dataclass
class Routing:
    experts: torch.Tensor  # (N, K) long: global expert of each choice, the most important choice first
    weights: torch.Tensor  # (N, K) combine weight of each choice (used where `routed`)
    routed: torch.Tensor  # (N, K) bool: sent to its expert (within capacity; GShard: and sampled)
    aux_loss: torch.Tensor  # () weighted auxiliary loss
    attempted: torch.Tensor | int  # () choices that asked for their expert (before the capacity cut)
    probs: torch.Tensor | None = None  # (N, n) the softmax over all experts (softmax-topk, switch-top1)
    every: bool = False  # known on the host: every choice routed (no capacity, no sampling), `routed` all True


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


def sends_every_choice(router: type[Router] | Router, capacity_factor: float) -> bool:
    """Known on the host: every choice of every token goes to its expert (no capacity limit; not GShard's
    random routing, which leaves second choices unsent in training). `router`: a router or its class
    (ROUTERS[model.moe.router])."""
    return capacity_factor <= 0 and not router.random_routing


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


def router_rows(cfg: "MoEConfig") -> int:
    """Rows of the router's matrices: one per expert (hierarchical: per group, then per expert)."""
    return cfg.num_experts + (cfg.num_groups if cfg.router == "hierarchical" else 0)


def router_param_names(cfg: "MoEConfig") -> list[str]:
    """The router's parameters, each (router_rows, d_model): W_g, plus W_noise for noisy gates."""
    return ["weight", "w_noise"] if cfg.router in ("noisy-topk", "hierarchical") else ["weight"]


class Router(nn.Module, abc.ABC):
    """x (N, d) -> Routing. Subclasses implement `gate`; capacity and the aux weight are applied here."""

    random_routing = False  # does the gate leave some choices unsent in training (GShard)?

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
        every = sends_every_choice(self, self.capacity)
        return Routing(experts, weights, kept, loss, experts.numel() if every else routed.sum(), probs, every)

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
    buffer moved by `update_bias` after every optimizer step, never by the optimizer. Group-limited
    routing (model.moe.expert_groups, max_groups): the choice only among each token's best groups
    (`limit_groups`), the gates again from s alone."""

    def __init__(self, cfg: "MoEConfig", d_model: int):
        super().__init__(cfg, d_model)
        self.sigmoid, self.norm, self.bias_rate = cfg.score == "sigmoid", cfg.normalize_topk, cfg.bias_rate
        self.sequence = cfg.aux_loss_kind == "sequence"
        self.register_buffer("expert_bias", torch.zeros(self.n) if cfg.balance == "bias" else None)
        self.expert_groups = cfg.expert_groups
        self.kept_groups = cfg.groups_per_token if cfg.group_limited else None

    def gate(self, x, gen, seq_len):
        logits = self.logits(x, self.weight)  # (N, n)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        if self.expert_bias is None and self.kept_groups is None:
            top, experts = scores.topk(self.k, dim=-1)  # (N, k)
        else:  # the choice by s (+ b), the gates from s (a gather: distinct indices per row)
            choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
            if self.kept_groups is not None:
                choice = limit_groups(choice, self.expert_groups, self.kept_groups)
            experts = choice.topk(self.k, dim=-1).indices
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


def limit_groups(choice: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3 sec. 2.1.2, "node-limited routing", as its released code and
    transformers' n_group / topk_group run it): the n experts cut into `groups` equal consecutive
    groups, a token's group score the sum of its 2 best choice scores in the group (the paper's top
    K_r / M = 8 / 4; DeepSeek-V2 sec. 2.1.3 took the best one alone); `choice` (N, n) returned with
    every expert outside the token's `kept` best groups at -inf: a top-k over it reaches <= kept groups."""
    N, n = choice.shape
    per_group = choice.view(N, groups, n // groups)  # (N, G, n/G)
    score = per_group.topk(min(2, n // groups), dim=-1).values.sum(-1)  # (N, G)
    best = score.topk(kept, dim=-1).indices  # (N, kept)
    keep = torch.zeros(N, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, n)


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
    random_routing = True

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
    h = clean
    if noisy:
        h = clean + torch.randn(clean.shape, device=clean.device, dtype=clean.dtype, generator=gen) * std
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
        members = member.sum(0).clamp(min=1).unsqueeze(-1)
        load = load_p.sum(0).unsqueeze(-1) * (member.unsqueeze(-1) * load_s).sum(0) / members  # eq. 14
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
