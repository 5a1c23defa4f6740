"""FlatGroup.flatten: the reduce input ZeRO-2/3 fill from the gradients (one _foreach_copy_ between
dtypes), its missing tensors and its padding."""

import pytest
import torch
from torch import nn

from teratrain.parallel.flat import FlatGroup


@pytest.mark.parametrize("whole", [False, True])
def test_flatten_casts_each_gradient_into_its_place_and_zeroes_the_rest(whole):
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in ((6, 4), (5,), (3, 3), (7,))]
    group = FlatGroup([f"p{i}" for i in range(4)], params, world=4, rank=1, whole=whole)
    # in the group's order (whole=True deals the parameters into per-rank bins), as the engine passes them
    grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in group.params]
    grads[2] = None  # a parameter unused on this rank this step: its range counts as zero
    flat = group.flatten(grads, torch.float32, "cpu")
    assert flat.dtype == torch.float32 and flat.shape == (group.padded,) and group.padded % 4 == 0
    expected = torch.zeros(group.padded)
    for view, t in zip(group.views(expected), grads):
        if t is not None:
            view.copy_(t.float())  # bf16 -> fp32 is exact
    assert torch.equal(flat, expected)
