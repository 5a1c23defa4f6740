"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted linear layer y = W x + b becomes y = W x + b + (alpha / r) B A dropout(x), with W and b
frozen, A (r, d_in) initialized like any weight (random Gaussian, by its global name) and B
(d_out, r) at zero, so training starts from exactly the base model. Only A and B train: gradients
and optimizer state shrink to the adapters, r (d_in + d_out) per layer instead of d_in d_out.

Applied from outside, before tensor parallelism (parallel/parallelize.py), which splits each
adapter consistently with its base layer (parallel/tensor.py): a column-parallel W (rows split)
takes B's rows with it and keeps A whole; a row-parallel W (columns split) takes A's columns and
keeps B whole. The whole factor's gradient is then partial over tp, like a sequence-parallel norm's.
`merge` folds the trained adapters into W for export and generation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.config_base import ConfigError

ADAPTERS = ("lora_a", "lora_b")


class LoRALinear(nn.Module):
    """nn.Linear's `weight`/`bias` (frozen) plus `lora_a`/`lora_b`, under the same module path."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=dev))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=dev))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)  # (.., r) -> (.., d_out)
        return F.linear(x, self.weight, self.bias) + self.scale * delta


def apply_lora(model: nn.Module, cfg) -> None:
    """Swap every targeted linear layer of every block for a LoRALinear, and freeze everything else
    (embeddings, norms, head, MoE layers' routed experts, which are stacks and not linear layers):
    only the adapters train."""
    lc = cfg.lora
    if lc.rank == 0:
        return
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = 0
    for block in model.layers.values():
        for path, module in list(block.named_modules()):
            if path.rpartition(".")[2] in lc.targets and isinstance(module, nn.Linear):
                owner_path, _, leaf = path.rpartition(".")
                setattr(block.get_submodule(owner_path), leaf, LoRALinear(module, lc.rank, lc.alpha, lc.dropout))
                adapted += 1
    if not adapted:
        raise ConfigError(f"lora.targets {list(lc.targets)} name no linear layer of this model, so nothing would "
                          "train (the routed experts of MoE layers take no adapters); add the attention's wq wk "
                          "wv wo to lora.targets.")


class LoraInit:
    """The init of a model with adapters: A like any weight (`own`: by global name and seed), B at
    zero (the model starts as its base), everything else from `base`: teratrain's init, or a Hugging
    Face model's weights, whose `read_piece` (reading just a rank's piece) is kept."""

    def __init__(self, base, own):
        self.base, self.own = base, own
        if hasattr(base, "read_piece"):
            self.read_piece = self._read_piece

    def __call__(self, t: torch.Tensor, name: str) -> None:
        if name.endswith(".lora_b"):
            t.zero_()
        elif name.endswith(".lora_a"):
            self.own(t, name)
        else:
            self.base(t, name)

    def _read_piece(self, t: torch.Tensor, pl, lo: int = 0, hi: int | None = None) -> None:
        if not pl.name.endswith(ADAPTERS):
            self.base.read_piece(t, pl, lo, hi)
            return
        from teratrain.checkpoint.pieces import WholeTensors

        full = torch.empty(pl.global_shape, dtype=t.dtype, device=t.device)
        self(full, pl.name)
        WholeTensors({pl.name: full}, {}).read_piece(t, pl, lo, hi)


@torch.no_grad()
def fold(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """W + (alpha / r) B A, computed in fp32, in W's dtype."""
    return (w.float() + (alpha / a.shape[0]) * (b.float() @ a.float())).to(w.dtype)


@torch.no_grad()
def merge(weights: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Whole weights by name with adapters folded in (`fold`), adapters dropped."""
    out = {k: v for k, v in weights.items() if not k.endswith(ADAPTERS)}
    for name, a in weights.items():
        if name.endswith(".lora_a"):
            stem = name[: -len("lora_a")]
            out[stem + "weight"] = fold(out[stem + "weight"], a, weights[stem + "lora_b"], alpha)
    return out


@torch.no_grad()
def merge_from_checkpoint(model: nn.Module, ckpt_dir, alpha: float) -> None:
    """Fold a checkpoint's adapters into a plain model holding its base weights (read one adapter
    pair at a time from the logical checkpoint)."""
    from teratrain.checkpoint.consolidate import read_tensors

    for name, (a, b) in read_tensors(ckpt_dir, ".lora_a", ".lora_b"):
        w = model.get_parameter(name + ".weight")
        w.copy_(fold(w, a, b, alpha))

