"""Context parallelism (parallel.cp): each sample's sequence split over the cp ranks; attention is
the only layer that talks across them.

`apply_cp(model, rt, cfg)` swaps parameter-free modules of the decoder, nothing else:
- `model.sequence` (models/layers.py SequenceLayout) for `ContextSplit`. The loader hands every cp
  rank of a dp coordinate the same samples; this keeps the rank's chunks of the tokens and targets
  (cp_plan.py: chunks i and 2N-1-i of 2N, or pairs by attention work under data.document_mask),
  their positions (RoPE rows, learned positions) and documents, and the layout every block's
  attention reads (`ContextLayout`). Every other layer runs on T/cp tokens unchanged.
- each block's attention core for `RingCore` (ring_attention.py) or, with parallel.cp_form=all-to-all,
  `AllToAllCore`: Ulysses (Jacobs et al. 2023), one all-to-all turns (B, H, T/cp) sequence shards of
  q, k and v into (B, H/cp, T) head shards, attention runs over whole samples, and one all-to-all
  turns its output back. Key/value heads that cp does not divide are repeated for their query heads
  first (as grouped-query attention shares them).
The loss: a rank's is the mean over its chunks' tokens, as many on every rank, so the mean over the
dp x cp ranks is the mean over all tokens of the samples, and the engines' average over the `dp`
group (dp x cp, mesh.py) makes the gradient of exactly that (placement.py). Metrics count each token
once: tokens per step are the global batch's, and the loss is averaged over dp x cp.

data.document_mask without cp only sets the end-of-text id on the model's SequenceLayout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.config_base import ConfigError
from teratrain.models.layers import Positions, document_ids, document_mask
from teratrain.models.protocol import is_builtin
from teratrain.parallel.comm import swap_blocks
from teratrain.parallel.cp_plan import Block, Split, balanced, step_blocks, zigzag
from teratrain.parallel.ring_attention import Ring, ring_attention


@dataclass(frozen=True, eq=False)
class ContextLayout:
    """What attention needs of one forward's whole samples: the split, this cp rank, the positions of
    every rank's tokens (device tensors), this rank's calls per ring step, the documents (B, T) or
    None, and for the all-to-all form the ranks' positions end to end (`joined`) and where each
    position sits among them (`order`)."""

    split: Split
    rank: int
    positions: list[torch.Tensor]
    steps: list[list[Block]]
    docs: torch.Tensor | None
    joined: torch.Tensor
    order: torch.Tensor


def make_layout(split: Split, rank: int, docs: torch.Tensor | None, docs_host, device) -> ContextLayout:
    n = split.cp
    positions = [torch.as_tensor(split.positions(r), device=device) for r in range(n)]
    steps = [step_blocks(split, rank, (rank - s) % n, docs_host) for s in range(n)]
    joined = torch.cat(positions)
    return ContextLayout(split, rank, positions, steps, docs, joined, torch.argsort(joined))


class ContextSplit(nn.Module):
    """The model's SequenceLayout under context parallelism: this cp rank's chunks (module docstring).
    The causal split depends only on the length and is made once; a document-balanced one is made per
    forward from the samples' documents (one copy of the (B, T) ids to the host)."""

    def __init__(self, cp: int, rank: int, eot: int | None):
        super().__init__()
        self.cp, self.rank, self.eot = cp, rank, eot
        self._fixed: dict = {}  # (T, device) -> ContextLayout of the causal split

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None, start: int, rope):
        if tokens.dim() != 2 or start != 0:
            raise ValueError("context parallelism splits a forward's whole token sequences (B, T) from position 0")
        T = tokens.shape[1]
        if self.eot is None:
            key = (T, tokens.device)
            if key not in self._fixed:
                self._fixed[key] = make_layout(zigzag(self.cp, T), self.rank, None, None, tokens.device)
            layout = self._fixed[key]
        else:
            docs = document_ids(tokens, self.eot)  # (B, T)
            host = docs.cpu().numpy()
            layout = make_layout(balanced(self.cp, host), self.rank, docs, host, tokens.device)
        idx = layout.positions[self.rank]  # (T/cp,) this rank's positions
        cos_sin = (rope.cos[idx], rope.sin[idx]) if rope is not None else None
        docs = layout.docs[:, idx] if layout.docs is not None else None
        mine = targets[:, idx] if targets is not None else None
        return tokens[:, idx], mine, Positions(cos_sin, idx, docs, layout)


class RingCore(nn.Module):
    """A block's attention core as ring attention over the cp group (ring_attention.py)."""

    def __init__(self, group, ranks: list[int], fused: bool = True):
        super().__init__()
        self.group, self.ranks, self.fused = group, ranks, fused
        # eager between compiled pieces; wrapped here, not where it is defined: the wrapper imports
        # torch._dynamo (seconds), which a process without context parallelism need not pay at import
        self.attend = torch.compiler.disable(ring_attention)

    def forward(self, q, k, v, causal: bool, pos: Positions) -> torch.Tensor:
        lay = pos.layout
        ring = Ring(self.group, self.ranks, lay.rank, lay.steps, lay.positions, lay.docs, self.fused)
        return self.attend(q, k, v, ring, 1.0 / math.sqrt(q.shape[-1]))


class AllToAllCore(nn.Module):
    """A block's attention core as Ulysses' exchange of sequence shards for head shards (module docstring)."""

    def __init__(self, group, cp: int):
        super().__init__()
        self.group, self.cp = group, cp

    def forward(self, q, k, v, causal: bool, pos: Positions) -> torch.Tensor:
        lay, n = pos.layout, self.cp
        if k.shape[1] % n:  # too few key/value heads to split: each query head gets its own copy
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        qh, kh, vh = (self._to_heads(t, lay) for t in (q, k, v))  # (B, h/cp, T, hs) in position order
        mask = None
        if lay.docs is not None:
            at = torch.arange(qh.shape[2], device=q.device)
            mask = document_mask(lay.docs, lay.docs, at, at)  # (B, 1, T, T)
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=qh.shape[1] != kh.shape[1])
        return self._to_sequence(y, lay)

    def _to_heads(self, t: torch.Tensor, lay: ContextLayout) -> torch.Tensor:
        B, h, Tl, D = t.shape
        n = self.cp
        blocks = swap_blocks(t.reshape(B, n, h // n, Tl, D).transpose(0, 1), self.group)  # block j: rank j's tokens
        joined = blocks.permute(1, 2, 0, 3, 4).reshape(B, h // n, n * Tl, D)  # ranks' tokens end to end
        return joined.index_select(2, lay.order)

    def _to_sequence(self, y: torch.Tensor, lay: ContextLayout) -> torch.Tensor:
        B, h, T, D = y.shape
        n = self.cp
        joined = y.index_select(2, lay.joined).view(B, h, n, T // n, D).permute(2, 0, 1, 3, 4)
        blocks = swap_blocks(joined, self.group)  # block j: this rank's tokens, head group j
        return blocks.permute(1, 0, 2, 3, 4).reshape(B, n * h, T // n, D)


def apply_cp(model: nn.Module, rt, cfg) -> None:
    """Swap the sequence layout and attention cores (module docstring); data.document_mask alone sets
    the end-of-text id. Asks for the cp group now, so parallelize() connects it at start-up."""
    eot = document_eot(cfg)
    cp = rt.dims.cp
    if cp == 1:
        if eot is not None and is_builtin(model):
            model.sequence.eot = eot
        return
    if not is_builtin(model):
        raise ConfigError("parallel.cp splits teratrain's own decoder (its SequenceLayout and attention cores); "
                          "set parallel.cp=1 for a model of your own.")
    group, ranks, rank = rt.group("cp"), rt.mesh.ranks("cp"), rt.mesh.rank_in("cp")
    model.sequence = ContextSplit(cp, rank, eot)
    for block in model.layers:
        attn = block.attention
        attn.core = AllToAllCore(group, cp) if cfg.parallel.cp_form == "all-to-all" else RingCore(group, ranks)


def document_eot(cfg) -> int | None:
    """The end-of-text id that cuts documents under data.document_mask (None: no document mask)."""
    if not cfg.data.document_mask:
        return None
    if cfg.data.eot_id is None:
        raise ConfigError("data.document_mask cuts documents at the end-of-text token and this run knows no id for "
                          "it (no tokenizer with <|endoftext|>); set data.eot_id.")
    return cfg.data.eot_id
