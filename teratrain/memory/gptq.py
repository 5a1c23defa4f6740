"""GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"), on the grid of quantize.py.

For a linear layer W (out, in) whose inputs X (tokens, in) come from calibration text, GPTQ
minimizes ||X W^T - X Q^T||^2 column by column (Optimal Brain Quantization with a fixed column
order): quantize column j, then spread its error over the columns not yet quantized, weighted by
the inverse Hessian H^-1 of that objective, H = 2 X^T X (the factor 2 cancels and is dropped):

    err     = (w_j - q_j) / [U]_jj
    W[:, k] -= err * [U]_jk           for every k > j

where U is the upper Cholesky factor of H^-1 (sec. 3, "Cholesky reformulation": its row j holds the
inverse Hessian of the columns >= j after j-1 eliminations, precomputed once and numerically
stable). Dampening adds percdamp * mean(diag(H)) to the diagonal (sec. 3, step 3). Lazy batch
updates (sec. 3, step 2): the loop above runs inside a block of B columns; columns beyond the block
receive the block's accumulated errors in one matmul, W[:, end:] -= Err @ U[block, end:]. With
group-wise scales the block is one group, so each group's grid is found from its columns as the
errors of earlier groups have left them (the reference's "groupsize" mode). Columns are taken in
their natural order (no act-order). Inputs never seen (diag(H) = 0) are set to zero.

The model is quantized block by block (sec. 4, "Step 3"): the calibration inputs of block i are the
outputs of blocks < i *already quantized*, so each block corrects for the error of those before it.
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.memory.quantize import (QuantizedWeight, block_linears, columns_per_group, grid, quantize_with,
                                       swap_in)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, block: int = 128,
                  percdamp: float = 0.01) -> QuantizedWeight:
    """Quantize W (out, in) given H = X^T X (in, in)."""
    W = w.detach().float().clone()
    H = H.detach().float().clone()
    out, inp = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    U = _inverse_cholesky_upper(H, percdamp)
    g = columns_per_group(group_size, inp)
    per_channel = g == inp
    bs = block if per_channel else g
    codes = torch.zeros(out, inp, device=W.device)
    scales, zeros = [], []
    if per_channel:
        s, z = grid(W, bits)
        scales, zeros = [s], [z]
    for i1 in range(0, inp, bs):
        i2 = min(i1 + bs, inp)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        if not per_channel:  # one group per block: its grid from the columns as they are now
            s, z = grid(W1, bits)
            scales.append(s)
            zeros.append(z)
        for i in range(i2 - i1):
            col = W1[:, i:i + 1]  # (out, 1)
            q = quantize_with(col, s, z, bits)
            codes[:, i1 + i] = q[:, 0]
            err = (col - (q - z) * s) / U1[i, i]
            W1[:, i:] -= err * U1[i:i + 1, i:]  # compensate the columns of this block not yet quantized
            Err1[:, i] = err[:, 0]
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # lazy batch update of everything after the block
    return QuantizedWeight(codes.to(torch.uint8), torch.cat(scales, 1).half(), torch.cat(zeros, 1).to(torch.uint8),
                           bits, g)


def _inverse_cholesky_upper(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp*I)^-1; the dampening grows x10 until H is positive definite."""
    damp = percdamp * torch.diag(H).mean()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if not info:
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        damp = damp * 10 if damp > 0 else torch.diag(H).mean() * 1e-2
    raise ValueError("the calibration Hessian stays singular after dampening; use more calibration batches")


class _Stop(Exception):
    pass


@torch.no_grad()
def block_inputs(model: nn.Module, tokens: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """The hidden states entering the first block for each calibration batch, and the RoPE tables,
    taken from the model's own forward (stopped at the block stack)."""
    seen: list = []

    def catch(_, args):
        seen.append(args[:2])  # (h, rope)
        raise _Stop

    handle = model.layers.register_forward_pre_hook(catch)
    try:
        for x in tokens:
            try:
                model(x)
            except _Stop:
                pass
    finally:
        handle.remove()
    return [h for h, _ in seen], seen[0][1]


@torch.no_grad()
def gptq_model(model: nn.Module, tokens: list[torch.Tensor], bits: int, group_size: int,
               percdamp: float = 0.01) -> dict[str, QuantizedWeight]:
    """Quantize every block linear of `model` in place (QuantLinear swapped in), block by block on
    inputs that went through the already-quantized blocks. `tokens`: calibration batches (B, T)."""
    model.eval()
    hs, rope = block_inputs(model, tokens)
    names = block_linears(model)
    out: dict[str, QuantizedWeight] = {}
    for i, blk in enumerate(model.layers):
        prefix = f"layers.{i}."
        mine = {n[len(prefix):]: blk.get_submodule(n[len(prefix):]) for n in names if n.startswith(prefix)}
        H = {n: torch.zeros(m.in_features, m.in_features, device=m.weight.device) for n, m in mine.items()}
        hooks = [m.register_forward_pre_hook(_accumulate(H, n)) for n, m in mine.items()]
        for h in hs:
            blk(h, rope)
        for hook in hooks:
            hook.remove()
        for n, m in mine.items():
            out[prefix + n] = q = gptq_quantize(m.weight, H[n], bits, group_size, percdamp=percdamp)
            swap_in(blk, n, q)
        hs = [blk(h, rope) for h in hs]  # what the next block sees: this block, quantized
    return out


def _accumulate(H: dict, name: str):
    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()  # (tokens, in)
        H[name] += x.T @ x
    return hook
