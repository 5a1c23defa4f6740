"""Mixture-of-experts feed-forward layer: n experts, a router chosen by config, expert capacity.

Single-device code. The routed rows are laid out by expert on the device (models/permute.py) and
run as grouped GEMMs (models/grouped.py), with no read-back to the host. Expert parallelism
(parallel/expert.py) replaces only `MoE.exchange`, which takes each routed token to the ranks that
hold its experts and brings back its gate-weighted expert outputs.

The router (models/routers.py) picks each token's experts, gates and capacity and computes the aux
loss; `aux_loss_convention = "transformers"` (softmax-topk) replaces the sum of the layers' losses by
transformers' Mixtral loss: n * sum_e (c_e / T)(S_e / T) with c_e the choices of expert e, S_e its
summed softmax and T the tokens, all pooled over the layers (per layer: k times ours). A choice
dropped by capacity is not sent to its expert: its output is zero and the token passes through the
residual connection. Drops are counted (`pop_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.compat import in_backward
from teratrain.models.grouped import cast_stacks, compute_dtype, row_align, run_experts, use_grouped
from teratrain.models.layers import to_compute_dtype
from teratrain.models.permute import Layout, combine, dispatch, grouped_layout
from teratrain.models.routers import ROUTERS, Routing, router_param_names, router_rows

if TYPE_CHECKING:
    from teratrain.config_model import ModelConfig

# the expert-parallel exchanges' statistics (MoE.count_exchange): rows that carried a token, rows sent
EXCHANGE_STATS = ("carried", "slots")


class Expert(nn.Module):
    """The shared experts' MLP (their sum is one MLP as wide as all of them), as each routed expert
    computes it (`Experts`): SwiGLU w2(silu(w1 x) * w3 x) (llama) or GELU w2(gelu(w1 x)) (gpt2), with
    dropout on its hidden activations (Switch's expert dropout, sec. 2.4)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, dropout: float, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            x = to_compute_dtype(x)  # one cast for w1 and w3
            h = F.silu(self.w1(x)) * self.w3(x)
        else:
            h = F.gelu(self.w1(x), approximate="tanh")
        return self.w2(self.dropout(h))


class Experts(nn.Module):
    """The routed experts of an MoE layer, each weight one stack over the experts: w1 and, gated, w3
    (E, d_ff, d), w2 (E, d, d_ff), expert e's being the (out, in) weight of its Expert's linear; biases
    b1, b3 (E, d_ff) and b2 (E, d) where the model has them. One parameter a weight, not one per
    expert: the optimizer, the gradient accumulation and the casts each see three tensors a layer
    whatever the expert count (128 experts of 8 layers were 3,072 parameters a step, each with its own
    kernels and autograd node), and the grouped GEMM reads the stacks as they are. Expert parallelism
    keeps rows of dim 0 (parallel/ep_plan.py), tensor parallelism splits d_ff (parallel/tensor.py)."""

    def __init__(self, n: int, d_model: int, d_ff: int, bias: bool, dropout: float, gated: bool):
        super().__init__()
        stack = lambda *shape: nn.Parameter(torch.empty(n, *shape))  # noqa: E731
        self.w1, self.w3, self.w2 = stack(d_ff, d_model), stack(d_ff, d_model) if gated else None, stack(d_model, d_ff)
        self.b1 = stack(d_ff) if bias else None
        self.b3 = stack(d_ff) if bias and gated else None
        self.b2 = stack(d_model) if bias else None
        self.dropout = nn.Dropout(dropout)
        self.bias_share: float | None = None  # tensor parallelism: b2 added times this, 0 on all but one tp rank
        # {leaf: its weight stack in the compute dtype; "w13": w1 and w3 side by side, under train.compile} where
        # the step casts them once for its micro-batches (memory/step_casts.py); None: each forward casts them
        # (models/grouped.py cast_stacks)
        self.step_casts: dict[str, torch.Tensor] | None = None
        # {leaf: its weight's gradient before this micro-batch}, carried through the cast's backward
        # (models/grouped.py MadeCast; memory/step_casts.py take_grads); None: autograd accumulates
        self.grad_acc: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.w1.shape[0]

    def leaves(self) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, weight stack, bias stack or None) of w1, w3 (gated only) and w2, in that order."""
        b2 = self.b2 * self.bias_share if self.b2 is not None and self.bias_share is not None else self.b2
        out = [("w1", self.w1, self.b1), ("w3", self.w3, self.b3), ("w2", self.w2, b2)]
        return [leaf for leaf in out if leaf[1] is not None]


class MoE(nn.Module):
    """The feed-forward layer of an MoE block: (B, T, d) -> (B, T, d). The experts are stacked
    (`Experts`); expert parallelism keeps its rows of the stacks, under the same names.

    Dispatch: each of the N*K choices has a key, its expert or n when it is not sent; the rows are
    laid out by expert on the device by a permutation whose forward and backward are gathers
    (models/permute.py), the experts run as one grouped GEMM per weight (compiled, w1 and w3 one), or one
    by one (`kernel`; models/grouped.py), and the outputs are gathered back, weighted and summed per
    token; no device value is read back to the host."""

    def __init__(self, cfg: "ModelConfig", layer: int):
        super().__init__()
        m = cfg.moe
        self.num_experts, self.layer = m.num_experts, layer
        self.router = ROUTERS[m.router](m, cfg.d_model)
        drop = cfg.dropout if m.expert_dropout is None else m.expert_dropout
        self.experts = Experts(m.num_experts, cfg.d_model, cfg.expert_ffn_dim, cfg.use_bias, drop, cfg.arch == "llama")
        # shared experts (DeepSeek-MoE): one MLP as wide as all of them together, which is their sum
        self.shared_expert = Expert(cfg.d_model, cfg.shared_ffn_dim, cfg.use_bias, drop, cfg.arch == "llama") \
            if m.shared_experts else None
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if m.shared_gate else None  # Qwen2-MoE
        self.dropout = nn.Dropout(cfg.dropout)
        self.convention, self.aux_weight = m.aux_loss_convention, m.aux_loss_weight
        self.kernel = "auto"  # grouped GEMM where it runs without a read-back; "grouped" / "loop" force one
        self.exchange = None  # expert parallelism: (flat, key, w, k, max_rows, moe) -> (out, counts); None: all here
        self.routing_seed: int | None = None  # draw router noise from a generator seeded per forward (seed_routing)
        self.aux_loss: torch.Tensor | None = None  # of the latest forward; the model adds it to the loss
        self.balance: tuple | None = None  # transformers convention: (choices (n,), summed softmax (n,), tokens)
        self.stats: dict[str, torch.Tensor] = {}
        # replayed as a CUDA graph (start_stats says so): the statistics' tensors, made once (see settle_stats)
        self._held: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        r = self.router(flat, self._generator(x.device), x.shape[1] if x.dim() == 3 else None)
        N, K = r.experts.shape
        if r.every:  # nothing dropped or unsampled: no masking (two kernels and their backward fewer)
            key, w = r.experts.flatten(), r.weights
        else:
            key = torch.where(r.routed, r.experts, self.num_experts).flatten()  # (N*K,) token-major; n: not sent
            w = torch.where(r.routed, r.weights, 0.0)  # (N, K)
        shared = _Once(lambda: self._shared(flat)) if self.shared_expert is not None else None
        if self.exchange is None:
            ys, lay = self.run_local(flat, key, K, every=r.every)
            out, counts = combine(ys, lay, w.to(ys.dtype), K), lay.counts  # (N, d); all choices dropped: zero
        else:  # the shared experts run while the dispatch moves
            out, counts = self.exchange(flat, key, w, K, self.router.max_rows(N, K), self, shared)
        if shared is not None:
            out = out + shared().to(out.dtype)
        self._set_aux(r)
        self._record(r, counts)
        return self.dropout(out.view(x.shape))

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts' output on every token (Qwen2-MoE's scaled by its sigmoid gate)."""
        shared = self.shared_expert(flat)
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(self.shared_expert_gate(flat))
        return shared

    def run_local(self, x: torch.Tensor, key: torch.Tensor, k: int = 1,
                  stacks: dict | None = None, every: bool = False) -> tuple[torch.Tensor, Layout]:
        """This module's experts on rows of x: input row i (x[i // k]) goes to the key[i]-th of them,
        nowhere for key len(self.experts). Returns the experts' outputs laid out by the returned
        layout (models/permute.py: `combine` brings them back to the input rows). `stacks`: from
        `stacked`, shared by several calls of one forward. `every`: no key is len(self.experts) (known on
        the host: nothing dropped), so the permutations mask nothing."""
        grouped = use_grouped(self.experts, x, self.kernel)
        lay = grouped_layout(key, len(self.experts), row_align(grouped), every)
        return run_experts(self.experts, dispatch(x, lay, k, compute_dtype(x)), lay.offsets, grouped, stacks), lay

    def stacked(self, x: torch.Tensor) -> dict | None:
        """This module's expert stacks cast for run_local on rows like x, shared by the calls of one forward
        (a chunked exchange runs the experts once per chunk): for the grouped GEMMs, or for the loop where
        the step cast them ahead (the one cast that carries their gradients so far, models/grouped.py
        cast_stacks); else None, each call casting its own."""
        if use_grouped(self.experts, x, self.kernel) or self.experts.step_casts:
            return cast_stacks(self.experts, compute_dtype(x), take_acc=True)
        return None

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
        if not self._counting():
            return
        new = {"load": counts, "dropped": 0 if r.every else r.attempted - r.routed.sum(), "attempted": r.attempted,
               "aux_loss": self.aux_loss.detach(), "forwards": 1}
        for key, value in new.items():  # one addition each (into the float64 sums), none for nothing dropped
            if key not in self.stats:
                self.stats[key] = torch.as_tensor(value, dtype=torch.float64, device=counts.device)
            elif not (isinstance(value, int) and value == 0):
                self.stats[key] = self.stats[key] + value

    def _counting(self) -> bool:
        """Are the statistics counted in this forward: in training, not where recomputation replays it inside
        backward (compiled, recomputation replays the traced graph, never this Python)?"""
        return self.training and (torch.compiler.is_compiling() or not in_backward())

    @torch.no_grad()
    def count_exchange(self, rows: torch.Tensor | int, slots: int) -> None:
        """An expert-parallel exchange's rows this rank sent (`slots`, padding included) and how many of
        them carried a token (`rows`): the padding a padded exchange moves (parallel/expert.py,
        expert_dedup.py). Kept as _record keeps its statistics, where start_stats made the keys."""
        if "slots" not in self.stats or not self._counting():
            return
        self.stats["carried"] = self.stats["carried"] + rows
        self.stats["slots"] = self.stats["slots"] + slots

    def start_stats(self, device: torch.device, graphed: bool = False) -> None:
        """Zero statistics on `device`, before the first forward (parallelize does it). From then on their
        keys and shapes stay the same (`pop_stats` resets them to zeros), so a compiled forward traces
        one graph, not one that creates them and one that adds to them. `graphed`: the forward replays
        as a CUDA graph (train.compile_mode=reduce-overhead), see `settle_stats`."""
        kw = {"dtype": torch.float64, "device": device}
        self.stats = {"load": torch.zeros(self.num_experts, **kw),  # the keys in _record's order, then the exchange's
                      **{key: torch.zeros((), **kw) for key in ("dropped", "attempted", "aux_loss", "forwards")},
                      **{key: torch.zeros((), **kw) for key in EXCHANGE_STATS}}
        self._held = dict(self.stats) if graphed else None

    def settle_stats(self) -> None:
        """A CUDA graph's replay (train.compile_mode=reduce-overhead) leaves the statistics it summed in
        the graph's memory pool, which the next step's replay overwrites while reading them as its
        inputs ("accessing tensor output of CUDAGraphs that has been overwritten"): copied out after each
        micro-batch (train_step), 7 small copies a layer, into tensors made once (start_stats): the graph reads
        the sums as inputs at the addresses it was recorded with, and a sum at a new address made CUDA graph
        trees record the whole graph again, at every step with one micro-batch a step (one H100, an 8-expert
        model at one micro-batch of 8: 200-520 ms a step against 116 compiled). Eager and compiled without
        graphs: nothing."""
        if self._held is not None:
            for key, value in self.stats.items():
                if value is not self._held[key]:
                    self._held[key].copy_(value)
            self.stats = dict(self._held)

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """This rank's statistics since the last call: load (n,) routed tokens per expert, dropped and
        attempted choices, summed aux loss and the forwards they came from, the exchanges' rows that
        carried a token and all they sent (EXCHANGE_STATS); then reset to zeros of
        the same keys (empty stays empty; graphed, the held tensors zeroed in place)."""
        if self._held is not None:
            out = {key: value.clone() for key, value in self.stats.items()}
            for value in self._held.values():
                value.zero_()
            self.stats = dict(self._held)
            return out
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


class _Once:
    """A value computed at its first call and kept: the shared experts' output, which an exchange
    computes while its dispatch moves (parallel/ep_pipeline.py) and the layer adds after."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.make()
        return self.value


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
