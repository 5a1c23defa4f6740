"""models/swiglu_kernel.py's Triton kernels run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a
process of their own: the variable must be set before the kernels are defined), where Triton is installed:
the forward and the joined backward of every tile `config` picks, and of other tiles, against float64 autograd
of silu(y1) * y3, within 1e-6 relative of each tensor's largest (fp32 inputs: the kernels' arithmetic is
fp32). Widths that are powers of 2 and not, rows that fill no whole tile. On a GPU
tests/gpu/test_swiglu_kernel_cuda.py runs the compiled kernels."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from teratrain.models import swiglu_kernel as sk
    for rows, f in [(37, 2816), (65, 768), (33, 40), (5, 128), (3, 4096)]:
        for cfg in [sk.config(f), (1, 256, 4), (16, 512, 8)]:
            y, g = torch.randn(rows, 2 * f) * 3, torch.randn(rows, f)
            h, dy = torch.empty(rows, f), torch.empty(rows, 2 * f)
            sk.launch(sk._forward, rows, f, y, h, cfg=cfg)
            sk.launch(sk._backward, rows, f, y, g, dy, cfg=cfg)
            ref = y.double().requires_grad_()
            y1, y3 = ref.chunk(2, -1)
            h_ref = F.silu(y1) * y3
            (dy_ref,) = torch.autograd.grad(h_ref, ref, g.double())
            for got, want in ((h, h_ref), (dy, dy_ref)):
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-6, (rows, f, cfg, err)
    print("ok")
""")


def test_the_kernels_match_autograd_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
