"""compiled_ops_share (planner/calibration/common.toml, read by planner/time.py): the GPU kernels a compiled
training step launches, per eager kernel.

One Llama training step (forward, backward, fused AdamW, clipping; bf16 autocast over fp32 weights,
whole-logits loss) profiled with torch.profiler, eager and under train.compile (the whole model one
graph), at the shape of bench/train_step.py with fewer layers; prints one JSON object with the CUDA
kernels per step of each mode, split into the model's forward + backward and the optimizer step, and
the device time each spends in kernels. The planner charges the host, and the GPU's per-op gap, per
issued op; compiled, inductor's fused kernels are what is issued.

    python bench/calibrate/compile_kernels.py --out FILE           # on the GPU machine, ~2 min
    python bench/calibrate/compile_kernels.py --out FILE --write   # and the share into common.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common
from common import config, device, emit, env_info, fresh_compile  # noqa: E402

from teratrain.memory.precision import autocast  # noqa: E402
from teratrain.models.transformer import build_model  # noqa: E402
from teratrain.optim.engine import LocalEngine  # noqa: E402

SHAPE = ["model.arch=llama", "model.d_model=2048", "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=8192",
         "model.vocab_size=32000", "model.seq_len=2048", "model.tie_embeddings=false", "memory.precision=bf16",
         "train.grad_clip=1.0", "optim.lr=1e-4"]


def kernels(fn, dev) -> tuple[int, float]:
    """(CUDA kernels launched by one call of fn, their summed device seconds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(dev)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(evs), sum(e.device_time_total for e in evs) * 1e-6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--out")
    ap.add_argument("--write", action="store_true", help="write the share into planner/calibration/common.toml")
    args = ap.parse_args()
    dev = device()
    cfg = config(SHAPE + [f"model.n_layers={args.layers}"])
    x = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, cfg.model.seq_len + 1), device=dev)
    rows = {}
    for mode in ("eager", "compile"):
        fresh_compile()
        model = build_model(cfg.model, dev, seed=0)
        if mode == "compile":
            model.compile()
        engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, master_weights=False)

        def fwd_bwd():
            with autocast("bf16", dev):
                loss = model(x[:, :-1], x[:, 1:])
            engine.backward(loss)

        def opt():
            engine.step(cfg.optim.lr)

        for _ in range(3):
            fwd_bwd()
            opt()
        torch.cuda.synchronize(dev)
        (n_fb, s_fb), (n_opt, s_opt) = kernels(fwd_bwd, dev), kernels(opt, dev)
        rows[mode] = {"model_kernels": n_fb, "model_kernel_s": round(s_fb, 5), "optimizer_kernels": n_opt,
                      "optimizer_kernel_s": round(s_opt, 5)}
        model = engine = None
    share = rows["compile"]["model_kernels"] / rows["eager"]["model_kernels"]
    emit({"bench": "compile_kernels", **env_info(dev), "layers": args.layers, "micro_batch": args.micro_batch,
          "modes": rows, "compiled_kernel_share": round(share, 4)}, args.out)
    if args.write:
        _write(rows, round(share, 2), args)


def _write(rows: dict, share: float, args) -> None:
    from teratrain.planner.refit import write_calibration

    counts = f"{rows['compile']['model_kernels']} / {rows['eager']['model_kernels']} CUDA kernels"
    write_calibration("common", {"compiled_ops_share": {
        "value": share, "source": "bench/calibrate/compile_kernels.py", "runs": [args.out or "stdout"],
        "fit_error": f"counted: {counts}, {args.layers} blocks, micro-batch {args.micro_batch}"}})


if __name__ == "__main__":
    main()
