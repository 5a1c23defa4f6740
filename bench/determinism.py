"""Which kernels of a training step give different bits when run twice on the same inputs, on this GPU.

    python bench/determinism.py --out determinism.json     # one GPU, ~20 s
    python bench/determinism.py --smoke                    # CPU, tiny shapes

Why. The layout matrix (bench/layouts.py) records how far bf16 rounding alone moves one GPU's run
(its noise floor); the one-GPU MoE run in bf16 is not repeatable (two identical runs part from step 1
on, while the fp32 runs are bitwise equal). bf16 is where two kernels take over that fp32 does
not use: flash attention (scaled_dot_product_attention's flash backward accumulates dQ with atomic
adds in FA2) and the experts' grouped GEMM (torch._grouped_mm, models/grouped.py). Top-2 routing turns
any difference of the last bit into another expert choice, so the MoE run shows what the dense run
hides.

Each probe runs forward and backward twice on the same inputs and reports whether outputs and input/
weight gradients are bitwise equal, and the largest difference: scaled_dot_product_attention (causal,
the llama-1b head shape), torch._grouped_mm (uneven groups, two empty), one MoE layer with each expert
kernel, and a whole step (loss and every gradient) of the dense and of the MoE model. Each probe runs
with torch.use_deterministic_algorithms off and on (on: what `train.deterministic` runs; an op with no
deterministic kernel is reported as an error).
One JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402  (bench/, the script's own folder)
from teratrain import compat  # noqa: E402
from teratrain.checkpoint.state import deterministic_algorithms  # noqa: E402
from teratrain.config import load_config  # noqa: E402
from teratrain.models.transformer import build_model  # noqa: E402

SHAPES = {"gpu": {"batch": 2, "seq": 2048, "d": 2048, "heads": 16, "kv": 8, "ff": 2816, "layers": 2, "vocab": 32000},
          "smoke": {"batch": 2, "seq": 32, "d": 64, "heads": 4, "kv": 2, "ff": 64, "layers": 2, "vocab": 256}}


def _twice(fn, *inputs: torch.Tensor, module: torch.nn.Module | None = None) -> dict:
    """fn(*inputs) -> tensor or tuple of tensors, forward and backward twice on the same inputs: are its
    outputs, the inputs' gradients and (with `module`) its parameters' gradients the same bits?"""
    runs = []
    for _ in range(2):
        if module is not None:
            module.zero_grad(set_to_none=True)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(1)
        probes = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
        sum((o.float() * p.float()).sum() for o, p in zip(outs, probes)).backward()
        params = [] if module is None else [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
        runs.append([o.detach() for o in outs] + [x.grad for x in xs if x.grad is not None] + params)
    return _compare(*runs)


def _compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    diffs = [float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)]
    return {"bitwise_equal": all(torch.equal(x, y) for x, y in zip(a, b)), "max_abs_diff": max(diffs)}


def probe_sdpa(s: dict, dev, dtype) -> dict:
    hd = s["d"] // s["heads"]
    q, k, v = (torch.randn(s["batch"], s["heads"], s["seq"], hd, device=dev, dtype=dtype) for _ in range(3))
    return _twice(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)


def probe_grouped_mm(s: dict, dev, dtype) -> dict | None:
    if not compat.grouped_mm_without_sync(dev, dtype):
        return None  # the fallback is a loop of plain matmuls
    g, rows = 8, s["batch"] * s["seq"] * 2
    sizes = torch.tensor([3, 0, 5, 1, 2, 4, 1, 0], dtype=torch.float64)
    counts = (sizes / sizes.sum() * rows).floor().long() // 8 * 8
    counts[-2] += rows - counts.sum()  # every row in a group (rows past the last are left uncomputed)
    offs = counts.cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(rows, s["d"], device=dev, dtype=dtype)
    w = torch.randn(g, s["ff"], s["d"], device=dev, dtype=dtype) / s["d"] ** 0.5
    return _twice(lambda x, w: compat.grouped_mm(x, w.transpose(-2, -1), offs=offs), x, w)


def _model(s: dict, moe: bool, dev):
    sets = ["model.preset=llama-1b", f"model.n_layers={s['layers']}", f"model.d_model={s['d']}",
            f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv']}", f"model.d_ff={s['ff'] * (2 if not moe else 1)}",
            f"model.vocab_size={s['vocab']}", f"model.seq_len={s['seq']}"]
    if moe:
        sets += ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.capacity_factor=0"]
    return build_model(load_config(None, sets).model, dev, seed=0)


def probe_moe_layer(s: dict, dev, dtype, kernel: str) -> dict:
    layer = _model(s, True, dev).layers["0"].feed_forward
    layer.kernel = kernel
    x = torch.randn(s["batch"], s["seq"], s["d"], device=dev)

    def run(x):
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            return layer(x)
    return _twice(run, x, module=layer)


def probe_step(s: dict, dev, dtype, moe: bool) -> dict:
    model = _model(s, moe, dev)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), device=dev)

    def run():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            return model(tokens[:, :-1], tokens[:, 1:])
    return _twice(run, module=model)


def probes(s: dict, dev, dtype) -> dict:
    todo = {"sdpa": lambda: probe_sdpa(s, dev, dtype), "grouped_mm": lambda: probe_grouped_mm(s, dev, dtype),
            "moe_layer_auto": lambda: probe_moe_layer(s, dev, dtype, "auto"),
            "moe_layer_loop": lambda: probe_moe_layer(s, dev, dtype, "loop"),
            "dense_step": lambda: probe_step(s, dev, dtype, moe=False),
            "moe_step": lambda: probe_step(s, dev, dtype, moe=True)}
    out = {}
    for name, probe in todo.items():
        try:
            out[name] = probe()
        except RuntimeError as e:  # deterministic mode refuses an op that has no deterministic kernel
            out[name] = {"error": str(e).splitlines()[0][:300]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    s = SHAPES["smoke" if dev.type == "cpu" else "gpu"]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": "bf16", "shape": s}
    for flag in (False, True):  # True: what train.deterministic turns on
        deterministic_algorithms(flag)
        torch.manual_seed(0)
        result["deterministic_algorithms" if flag else "default"] = probes(s, dev, dtype)
    emit(result, args.out)


if __name__ == "__main__":
    main()
