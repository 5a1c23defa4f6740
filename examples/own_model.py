"""Train a decoder of your own with teratrain (the model protocol: teratrain/models/protocol.py).

    python examples/own_model.py                                   # one process
    torchrun --nproc-per-node 2 examples/own_model.py --set parallel.zero=3 --set memory.recompute=full
    python examples/own_model.py --hf llama                        # a transformers LlamaForCausalLM instead

The model below is plain PyTorch: nothing in it knows about teratrain beyond the protocol's four
points: forward(tokens, targets) returns the mean loss; parameter names are stable; the blocks are
listed by `teratrain_blocks()`; `init_parameter` / `init_buffers` give first values on the meta
device. It trains under data parallelism, ZeRO 1-3 with offload, recompute=full and the other sync
modes, and its checkpoints reshard like teratrain's own; tensor, pipeline and expert parallelism need
teratrain's own decoder and are refused with one sentence.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn

import teratrain


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, d/heads)
        h = h + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class TinyDecoder(nn.Module):
    """Sinusoidal positions (a buffer), pre-norm blocks, an output layer tied to the embedding."""

    def __init__(self, vocab: int, d: int, n_layers: int, heads: int, seq_len: int, seed: int = 0):
        super().__init__()
        self.seed, self.seq_len = seed, seq_len
        self.embed = nn.Embedding(vocab, d)
        self.register_buffer("positions", torch.empty(seq_len, d), persistent=False)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, `embed.weight`

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens) + self.positions[:tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))  # (B, T, V)
        return logits if targets is None else F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # ---- the protocol
    def teratrain_blocks(self):
        return [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]

    @torch.no_grad()
    def init_parameter(self, t: torch.Tensor, name: str) -> None:
        """A whole parameter from its name and the seed only (so every layout starts alike)."""
        if name.endswith("bias"):
            t.zero_()
        elif ".ln" in name or name.startswith("ln_f"):
            t.fill_(1.0)
        else:
            g = torch.Generator(device=t.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            t.normal_(0.0, 0.02, generator=g)

    @torch.no_grad()
    def init_buffers(self, device) -> None:
        d = self.embed.weight.shape[1]
        pos = torch.arange(self.seq_len, device=device).float().unsqueeze(1)
        freq = torch.exp(torch.arange(0, d, 2, device=device).float() * (-math.log(10000.0) / d))
        table = torch.zeros(self.seq_len, d, device=device)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.positions = table


def tiny_decoder(cfg) -> nn.Module:
    m = cfg.model
    with torch.device("meta"):  # no memory until teratrain materializes each rank's part
        return TinyDecoder(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.seq_len, cfg.train.seed)


def hf_llama(cfg) -> nn.Module:
    """A transformers Llama built on the CPU (its values are kept), through the protocol's adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                                      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                                      num_key_value_heads=m.kv_heads, max_position_embeddings=m.seq_len))
    return teratrain.CausalLM(hf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", choices=["llama"], help="train a transformers model instead of TinyDecoder")
    parser.add_argument("--out", default="runs/own-model")
    parser.add_argument("--resume", action="store_true", help="continue --out from its newest checkpoint (any layout)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    try:
        cfg = teratrain.load_config(None, ["model.n_layers=4", "model.d_model=128", "model.n_heads=4",
                                           "train.steps=100", *args.sets])
        summary = teratrain.run(cfg, out=args.out, resume=args.resume, model_fn=hf_llama if args.hf else tiny_decoder)
    except teratrain.ConfigError as e:  # bad input: one sentence (from the first rank) and status 2, as the CLI does
        if os.environ.get("RANK", "0") == "0":
            print(f"own_model.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if summary.get("step") and summary["rank"] == 0:  # every rank returns the same losses: one says them
        print(f"done: {summary['step']} steps, loss {summary['loss']:.4f} -> {summary['run_dir']}")


if __name__ == "__main__":
    main()
