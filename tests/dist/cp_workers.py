"""Bodies of the context-parallel tests that run inside spawned ranks (module-level, so `spawn` can
import them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teratrain.models.layers import document_ids, document_mask

EOT = 0  # the end-of-text id of the random samples with documents


def samples(B: int, T: int, docs: bool, seed: int = 0) -> torch.Tensor:
    """(B, T) random ids in 1..49; with `docs`, end-of-text tokens (0) cut them into documents of
    unequal lengths, including one of a single token (two in a row)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (B, T), generator=g)
    if docs:
        for row, cuts in enumerate([(5, 20), (11, 12, 30), (2, 3, 4, 27)][:B]):
            tokens[row, [c % T for c in cuts]] = EOT
    return tokens


def attention_vs_whole(rank: int, world: int, cases: list[tuple], dtype=torch.float64) -> list[dict]:
    """Per case (form, docs, fused): one context-parallel attention forward and backward on this
    rank's chunks against torch's SDPA over the whole samples (autograd), by relative L2 error of
    the output and of the gradients of q, k and v, on this rank's rows."""
    import torch.distributed as dist

    from teratrain.parallel.context import AllToAllCore, ContextSplit, RingCore

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = []
    for form, docs, fused in cases:
        g = torch.Generator().manual_seed(1)
        B, H, Hkv, T, D = 3, 4, 2, 16 * world, 8
        q, k, v, dout = (torch.randn(B, h, T, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv, H))
        tokens = samples(B, T, docs)
        _, _, pos = ContextSplit(world, rank, EOT if docs else None)(tokens, None, 0, None)
        idx = pos.index
        mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        group = dist.group.WORLD
        core = RingCore(group, list(range(world)), fused) if form == "ring" else AllToAllCore(group, world)
        y = core(*mine, True, pos)
        y.backward(dout[:, :, idx])
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        if docs:
            d, at = document_ids(tokens, EOT), torch.arange(T)
            ref = F.scaled_dot_product_attention(*whole, attn_mask=document_mask(d, d, at, at), enable_gqa=True)
        else:
            ref = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
        ref.backward(dout)
        err = lambda a, b: float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())  # noqa: E731
        errs = {"out": err(y, ref[:, :, idx])}
        errs.update({f"d{n}": err(m.grad, w.grad[:, :, idx]) for n, m, w in zip("qkv", mine, whole)})
        out.append({"errors": errs, "chunks": pos.layout.split.chunks})
    return out


def compiled(rank: int, world: int, layouts: list[list[str]], steps: int) -> list[dict]:
    """Each layout with train.compile under aot_eager (the traced forward and backward graphs run
    eagerly: inductor adds nothing to what is checked), fullgraph where the layout says so
    (`fullgraph=true` in the list, consumed here); with the run's graph breaks and graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from layout_workers import train_random

    compile_module, compile_fn = torch.nn.Module.compile, torch.compile
    runs = []
    try:
        for layout in layouts:
            full = "fullgraph=true" in layout
            torch.nn.Module.compile = lambda self, **_: compile_module(self, backend="aot_eager", fullgraph=full)
            torch.compile = lambda fn, **_: compile_fn(fn, backend="aot_eager", fullgraph=full)
            torch._dynamo.reset()
            counters.clear()
            run = train_random(rank, world, [o for o in layout if o != "fullgraph=true"] + ["train.compile=true"],
                               steps=steps)
            runs.append({**run, "graph_breaks": sum(counters["graph_break"].values()),
                         "graphs": counters["stats"]["unique_graphs"]})
    finally:
        torch.nn.Module.compile, torch.compile = compile_module, compile_fn
    return runs
