"""Decoder-only transformer in two flavours, Llama-style and GPT-2-style, built from `layers.py`.

Shaped for strategies applied from outside: blocks live in `self.layers`, keyed by their global index
(`layers.17` on whatever pipeline stage holds it), every linear layer has a stable name, any of
`tok_embeddings`, `norm`, `output` may be set to None by a pipeline split, the head and the loss are
modules a strategy can swap (vocab-parallel under tensor parallelism), and the model is built on
the meta device and materialized with `init_weights`.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.models import moe, routers
from teratrain.models.chunked_loss import ChunkedHeadLoss, aligned, padded_vocab
from teratrain.models.layers import (Attention, GeluMLP, KVCache, LayerNorm, Positions, RMSNorm, Rotary, SequenceLayout,
                                     SwiGLU, to_compute_dtype)

if TYPE_CHECKING:
    from teratrain.config_model import ModelConfig


class Block(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)) (the MLP a mixture of
    experts in the layers model.moe selects)."""

    def __init__(self, cfg: "ModelConfig", layer: int = 0):
        super().__init__()
        d, bias = cfg.d_model, cfg.use_bias
        self.attention_norm = _norm(cfg)
        self.attention = Attention(d, cfg.n_heads, cfg.kv_heads, bias, cfg.dropout, cfg.qkv_bias, cfg.qk_norm,
                                   cfg.norm_eps, cfg.head_width)
        self.ffn_norm = _norm(cfg)
        mlp = SwiGLU if cfg.arch == "llama" else GeluMLP
        self.feed_forward = moe.MoE(cfg, layer) if cfg.moe.is_moe_layer(layer) else mlp(d, cfg.ffn_dim, bias, cfg.dropout)

    def forward(self, h: torch.Tensor, pos: Positions | None = None, cache: KVCache | None = None,
                start: int = 0) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), pos, cache, start)
        return h + self.feed_forward(self.ffn_norm(h))


class Blocks(nn.ModuleDict):
    """The block stack, keyed by global layer index (`layers.0`, `layers.1`, ...; a pipeline stage
    keeps the keys of the blocks it holds). It can also run itself, so a recomputation policy can
    replace how it runs without renaming any parameter. Iteration yields the blocks in order."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, index: int | str) -> nn.Module:
        """The block of global layer `index` (an int or its key)."""
        return super().__getitem__(str(index))

    def forward(self, h: torch.Tensor, pos: Positions | None = None, caches: list[KVCache] | None = None,
                start: int = 0):
        for i, block in enumerate(self.values()):
            h = block(h, pos, caches[i] if caches else None, start)
        return h

    def part(self, keys) -> "Blocks":
        """The blocks of `keys` run the same way (a pipeline chunk), sharing the block modules."""
        return Blocks({str(k): self[k] for k in keys})


def _norm(cfg: "ModelConfig") -> nn.Module:
    if cfg.arch == "llama":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.use_bias)


class Transformer(nn.Module):
    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        llama = cfg.arch == "llama"
        self.rope = Rotary(cfg.head_width, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling) if llama else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.sequence = SequenceLayout()  # parameter-free; swapped by context parallelism
        self.layers = Blocks({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = _norm(cfg)
        # Tied: the head reuses tok_embeddings.weight in forward(), so there is no second tensor to keep tied.
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tied_head = TiedHead()  # parameter-free; swapped by tensor parallelism
        self.pad_head = True  # training's head GEMMs over a padded vocabulary (head); off on pipeline stages
        self.criterion = LMLoss()
        self.chunked_loss = ChunkedHeadLoss(chunks=1)  # parameter-free, off; memory.loss_chunks sets its pieces

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, start: int = 0) -> torch.Tensor:
        """tokens: (B, T) ids (or (B, T, d) hidden states on a pipeline stage without embeddings).
        Returns the mean loss when `targets` (B, T) are given (in training plus the MoE layers' aux
        losses), else logits (B, T, V), or hidden states on a stage without the head."""
        T = tokens.shape[1]
        if start + T > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        tokens, targets, pos = self.sequence(tokens, targets, start, self.rope)  # this process's tokens
        h = self.embed(tokens, start, pos.index) if self.tok_embeddings is not None else tokens  # (B, T, d)
        h = self.layers(h, pos, caches, start)
        if self.norm is None:
            return h
        if targets is None:
            return self.head(h)  # (B, T, V)
        loss = self.loss(h, targets)  # ()
        aux = moe.aux_loss(self) if self.training else None
        return loss if aux is None else loss + aux

    def embed(self, tokens: torch.Tensor, start: int = 0, index: torch.Tensor | None = None) -> torch.Tensor:
        """Token (and learned position) embeddings, then dropout: (B, T) ids -> (B, T, d). `index`: the
        tokens' positions (T,) when they are not start..start+T (context parallelism's chunks)."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            at = index if index is not None else torch.arange(start, start + tokens.shape[1], device=h.device)
            h = h + self.pos_embeddings(at)
        return self.dropout(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection (tied: through the embedding): (B, T, d) -> (B, T, V). In training,
        where the head is one weight of a vocabulary not a multiple of chunked_loss.ALIGN, the GEMMs multiply
        it padded with zero rows (aligned rows: GPT-2's 50,257 ran far slower, models/chunked_loss.py) and the
        logits are a view of the padded ones' first V columns: the same values. Not on a pipeline's stages
        (pad_head off: their split backward reads the head's own graph)."""
        h = self.norm(h)
        weight = self.plain_head_weight()
        pads = weight is not None and padded_vocab(weight.shape[0]) != weight.shape[0]
        if pads and self.pad_head and torch.is_grad_enabled():
            h = to_compute_dtype(h)  # the padded weight is made in the GEMM's dtype, as autocast would cast it
            return F.linear(h, aligned(weight.to(h.dtype)))[..., :weight.shape[0]]
        return self.output(h) if self.output is not None else self.tied_head(h, self.tok_embeddings.weight)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head and mean loss of the last block's output h (B, T, d) against targets (B, T):
        fused and chunked (models/chunked_loss.py) where the head is one weight and the loss the plain
        one, else logits (B, T, V) and then the criterion (a vocab-parallel pair under tensor parallelism)."""
        weight = self.head_weight()
        if weight is not None:
            return self.chunked_loss(self.norm(h), weight, targets)
        return self.criterion(self.head(h), targets)

    def head_weight(self) -> torch.Tensor | None:
        """The (V, d) weight the chunked loss multiplies by, or None where it does not apply: chunking
        off (memory.loss_chunks=1), or the head or the loss swapped by a strategy."""
        if self.chunked_loss.chunks == 1 or type(self.criterion) is not LMLoss:
            return None
        return self.plain_head_weight()

    def plain_head_weight(self) -> torch.Tensor | None:
        """The head's one (V, d) weight (tied: the embedding's), or None where a strategy swapped the head."""
        if self.output is not None:
            return self.output.weight if type(self.output) is nn.Linear and self.output.bias is None else None
        return self.tok_embeddings.weight if type(self.tied_head) is TiedHead else None

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Materialized-parameter init. Each tensor draws from its own generator seeded by
        (seed, name), so a shard can be initialized identically to the full model's slice."""
        for name, p in self.named_parameters():
            init_param_(p, name, self.cfg, seed)
        self._reset_buffers()

    def _reset_buffers(self) -> None:
        """RoPE tables computed, MoE routers' expert biases (balance=bias) at zero."""
        if self.rope is not None:
            self.rope.reset()
        for _, layer in moe.moe_layers(self):
            if getattr(layer.router, "expert_bias", None) is not None:
                layer.router.expert_bias.zero_()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str) -> None:
        """Allocate and fill the non-parameter buffers (RoPE tables) on `device`, leaving parameters
        alone: for strategies that materialize parameters shard by shard themselves."""
        for mod in self.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                mod._buffers[name] = torch.empty_like(buf, device=device)
        self._reset_buffers()

    def make_caches(self, batch: int, max_len: int) -> list[KVCache]:
        p = self.tok_embeddings.weight
        return [KVCache(batch, self.cfg.kv_heads, max_len, self.cfg.head_width, p.device, p.dtype)
                for _ in self.layers]


def init_param_(t: torch.Tensor, name: str, cfg: "ModelConfig", seed: int) -> None:
    """Init one parameter by name: norms 1, biases 0, residual-output projections (wo, w2) get
    std/sqrt(2*n_layers) (GPT-2 paper, sec. 2.3), MoE routers as their paper says, everything
    else N(0, init_std)."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if parent == "experts":  # a stack of experts' weights (w1 w3 w2) or biases (b1 b3 b2): as their linears'
        parent, leaf = "w" + leaf[1:], "weight" if leaf.startswith("w") else "bias"
    g = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if leaf == "bias":
        t.zero_()
    elif parent.endswith("norm"):
        t.fill_(1.0)
    elif parent == "router":
        routers.init_router_(t, cfg, g)
    else:
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if parent in ("wo", "w2") else cfg.init_std
        t.normal_(0.0, std, generator=g)


def build_model(cfg: "ModelConfig", device: torch.device | str = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Construct on the meta device (no memory), then allocate and initialize on `device`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return materialize(model, device, seed).to(dtype)


def materialize(model: Transformer, device: torch.device | str, seed: int) -> Transformer:
    """Allocate a meta-device model's parameters and buffers on `device` and initialize them."""
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class LMLoss(nn.Module):
    """The training loss as a module, so a strategy can swap it (vocab-parallel cross-entropy)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)


class TiedHead(nn.Module):
    """The output projection through the input embedding's weight: h (B, T, d) -> (B, T, V)."""

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)


def count_params(cfg: "ModelConfig") -> dict[str, int]:
    """Parameter counts by arithmetic on the config (no tensors): total, embedding, and the
    matmul parameters N that the PaLM FLOP formula uses (every weight a token multiplies, head
    included: for MoE the active parameters, the router and the experts a token visits).
    `active`: the parameters one token uses (all but the experts it skips; Mixtral 8x7B: 12.9 B of
    46.7 B). `per_block` is a dense block's; `expert` counts every expert of every MoE layer."""
    d, L, hd = cfg.d_model, cfg.n_layers, cfg.head_width
    b = 1 if cfg.use_bias else 0
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    attn = d * (q + 2 * kv) + q * d + b * (q + 2 * kv + d) + (q + 2 * kv if cfg.qkv_bias else 0)
    qk_norm = {"none": 0, "head": 2 * hd, "full": q + kv}[cfg.qk_norm]
    n_mats = 3 if cfg.arch == "llama" else 2
    mlp = n_mats * d * cfg.ffn_dim + b * ((n_mats - 1) * cfg.ffn_dim + d)
    norm = d if cfg.arch == "llama" else d * (1 + b)
    block = attn + mlp + 2 * norm + qk_norm
    emb = cfg.vocab_size * d
    pos = cfg.seq_len * d if cfg.arch == "gpt2" else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = emb + pos + L * block + norm + head
    matmul = L * (attn + mlp) + cfg.vocab_size * d  # head matmul, tied or not
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(L))
    expert = n_mats * d * cfg.expert_ffn_dim + b * ((n_mats - 1) * cfg.expert_ffn_dim + d)  # one routed expert
    layer = moe.count_moe_block(cfg, expert) if n_moe else {"total": mlp, "active": mlp}
    total += n_moe * (layer["total"] - mlp)
    matmul += n_moe * (layer["active"] - mlp)
    return {"total": total, "embedding": emb + pos, "matmul": matmul, "per_block": block,
            "expert": n_moe * cfg.moe.num_experts * expert,
            "active": total - n_moe * (layer["total"] - layer["active"])}


def flops_per_token(cfg: "ModelConfig", seq_len: int | None = None) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12*L*H*Q*T (N matmul params, L layers,
    H heads, Q head dim, T sequence length); forward + backward, no recomputation."""
    T = seq_len or cfg.seq_len
    return 6 * count_params(cfg)["matmul"] + 12 * cfg.n_layers * cfg.n_heads * cfg.head_width * T
