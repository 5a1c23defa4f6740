"""Autoregressive sampling with a KV cache, temperature and top-k."""

from __future__ import annotations

import torch

from teratrain.models.transformer import Transformer


@torch.no_grad()
def sample(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 50, seed: int = 0, stop_token: int | None = None) -> list[int]:
    """Return the generated continuation of `prompt` (token ids, prompt excluded).

    The prompt is run once to fill the cache (prefill); each new token then costs one forward of a
    single position against the cached keys/values. temperature 0 means greedy decoding.
    """
    if not prompt:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    max_len = model.cfg.seq_len
    prompt = prompt[-(max_len - 1):]  # keep room for at least one new token
    max_new_tokens = min(max_new_tokens, max_len - len(prompt))
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = model.make_caches(1, len(prompt) + max_new_tokens)
    model.eval()
    tokens = torch.tensor([prompt], device=device)  # (1, T)
    logits = model(tokens, caches=caches, start=0)[:, -1]  # (1, V)
    out: list[int] = []
    pos = len(prompt)
    for _ in range(max_new_tokens):
        nxt = _pick(logits.float(), temperature, top_k, gen)  # (1, 1)
        tok = int(nxt)
        if tok == stop_token:
            break
        out.append(tok)
        logits = model(nxt, caches=caches, start=pos)[:, -1]
        pos += 1
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)
