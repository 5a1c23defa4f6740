"""The weight-side half of a backward node, computed from the node's saved tensors and the gradient
ZB-H1's I kept for it (backward.py): what autograd would compute into those of the node's edges
that lead to weights, and nothing into the edge toward the stage input (I did that already).

Each rule is the node's formula in torch's derivatives.yaml (tools/autograd/FunctionsManual.cpp),
with the same operand order and output layout, so W runs the GEMMs B runs, into gradients laid out
as B's (a weight cast's transpose stays a view, and AccumulateGrad takes it without a copy):
- MmBackward0 (`x @ W.T` of a linear without bias): mm_mat1_backward / mm_mat2_backward;
- AddmmBackward0 (a linear with bias): the same, times alpha, and the bias gradient grad * beta;
- MulBackward0 (RMSNorm's scale on CPU, where F.rms_norm is composite): grad times the other factor;
- NativeLayerNormBackward0: aten.native_layer_norm_backward with only the weight and bias outputs;
- FusedRmsNormBackward0 (F.rms_norm on CUDA): the scale's gradient of aten._fused_rms_norm_backward,
  sum over the leading dims of grad * input * rstd in the compute dtype.
`rule(node, grads, sides)` returns one gradient per index in `sides` (the node's next_functions
positions), before autograd's own reduction to the edge's shape and dtype (backward.py `_fit`).
"""

from __future__ import annotations

import torch


def _column_major(sizes, strides) -> bool:
    """A matrix stored transposed (FunctionsManual.cpp: then the gradient is made column-major too)."""
    return strides[0] == 1 and strides[1] == sizes[0]


def _mat1_grad(grad, mat2, sizes, strides):
    """d(mat1 @ mat2)/d mat1 (mm_mat1_backward)."""
    if _column_major(sizes, strides):
        return mat2.mm(grad.t()).t()
    return grad.mm(mat2.t())


def _mat2_grad(grad, mat1, sizes, strides):
    """d(mat1 @ mat2)/d mat2 (mm_mat2_backward)."""
    if _column_major(sizes, strides):
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _scaled(t: torch.Tensor, k) -> torch.Tensor:
    return t if k == 1 else t * k


def _mm(node, grads, sides):
    grad = grads[0]
    return [_mat2_grad(grad, node._saved_self, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides) if i == 1
            else _mat1_grad(grad, node._saved_mat2, node._saved_self_sym_sizes, node._saved_self_sym_strides)
            for i in sides]


def _addmm(node, grads, sides):
    grad, out = grads[0], []
    for i in sides:
        if i == 0:
            out.append(_scaled(grad, node._saved_beta))
        elif i == 1:
            out.append(_scaled(_mat1_grad(grad, node._saved_mat2, node._saved_mat1_sym_sizes,
                                          node._saved_mat1_sym_strides), node._saved_alpha))
        else:
            out.append(_scaled(_mat2_grad(grad, node._saved_mat1, node._saved_mat2_sym_sizes,
                                          node._saved_mat2_sym_strides), node._saved_alpha))
    return out


def _mul(node, grads, sides):
    return [grads[0] * (node._saved_self if i == 1 else node._saved_other) for i in sides]


def _layer_norm(node, grads, sides):
    (grad,) = grads
    mask = [False, 1 in sides, 2 in sides]
    got = torch.ops.aten.native_layer_norm_backward(grad, node._saved_input, node._saved_normalized_shape,
                                                    node._saved_result1, node._saved_result2, node._saved_weight,
                                                    node._saved_bias, mask)
    return [got[i] for i in sides]


def _fused_rms_norm(node, grads, sides):
    grad, x = grads[0], node._saved_input  # (its second output, rstd, gets no gradient)
    dtype = torch.promote_types(x.dtype, torch.float32)  # the kernel's compute dtype (fp32, or fp64)
    rstd = node._saved_result1
    while rstd.dim() < x.dim():
        rstd = rstd.unsqueeze(-1)
    outer = list(range(x.dim() - len(node._saved_normalized_shape)))
    d_weight = grad.to(dtype) * (x.to(dtype) * rstd)
    d_weight = (d_weight.sum(dim=outer) if outer else d_weight).to(x.dtype)
    return [d_weight for _ in sides]  # its only weight-side edge is the scale's (next_functions[1])


RULES = {"MmBackward0": _mm, "AddmmBackward0": _addmm, "MulBackward0": _mul,
         "NativeLayerNormBackward0": _layer_norm, "FusedRmsNormBackward0": _fused_rms_norm}
_READS = {"MmBackward0": ("_saved_self", "_saved_mat2", "_saved_self_sym_sizes", "_saved_self_sym_strides",
                          "_saved_mat2_sym_sizes", "_saved_mat2_sym_strides"),
          "AddmmBackward0": ("_saved_mat1", "_saved_mat2", "_saved_alpha", "_saved_beta", "_saved_mat1_sym_sizes",
                             "_saved_mat1_sym_strides", "_saved_mat2_sym_sizes", "_saved_mat2_sym_strides"),
          "MulBackward0": ("_saved_self", "_saved_other"),
          "NativeLayerNormBackward0": ("_saved_input", "_saved_normalized_shape", "_saved_result1", "_saved_result2",
                                       "_saved_weight", "_saved_bias"),
          "FusedRmsNormBackward0": ("_saved_input", "_saved_normalized_shape", "_saved_result1")}
_usable: dict[str, bool] = {}


def rule_for(node):
    """The node's rule, if its kind has one and the node holds what the rule reads (checked once per
    kind and process, by name: another torch may save under other names; then autograd runs it)."""
    name = node.name()
    rule = RULES.get(name)
    if rule is not None and name not in _usable:
        _usable[name] = set(_READS[name]) <= set(dir(node))
    return rule if rule is not None and _usable[name] else None
