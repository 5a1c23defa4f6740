"""`teratrain quantize`: post-training, weight-only quantization of a trained run.

    teratrain quantize --ckpt RUN --bits 8|4 --group-size 128 [--method rtn|gptq] [--out DIR]

Reads the run's full weights (any layout: checkpoint/consolidate.py), quantizes every linear layer of
the blocks (memory/quantize.py: RTN; memory/gptq.py: GPTQ on calibration batches of the run's own
training split), measures the held-out loss with the model as trained and quantized, on the run's
validation samples (the same ones training evaluated), and writes the quantized model folder, which
`teratrain generate --ckpt DIR` runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from teratrain.config_base import ConfigError
from teratrain.data.loader import Batches, prepare
from teratrain.generate import load_model
from teratrain.memory.gptq import gptq_model
from teratrain.memory.quantize import block_linears, is_quantized, quantize_rtn, save_quantized, swap_in, tensor_nbytes
from teratrain.mesh import Runtime
from teratrain.train import evaluate


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="post-training weight quantization of a trained run (RTN or GPTQ)")
    q.add_argument("--ckpt", required=True, help="run directory (or one of its checkpoint folders)")
    q.add_argument("--bits", type=int, choices=(4, 8), required=True, help="bits per weight")
    q.add_argument("--group-size", type=int, default=128,
                   help="input columns sharing one scale and zero point; 0 or -1 = one per output channel")
    q.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest; gptq: error-compensating (Frantar et al. 2022)")
    q.add_argument("--out", help="output folder (default <run>/quantized-w<bits>-g<group>-<method>)")
    q.add_argument("--calib-batches", type=int, default=8, help="GPTQ: micro-batches of training text to calibrate on")
    q.add_argument("--eval-batches", type=int,
                   help="held-out micro-batches (default: the run's train.eval_batches, or 4)")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    for flag, value in (("--calib-batches", args.calib_batches), ("--eval-batches", args.eval_batches)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}; give a positive number of micro-batches.")
    if args.group_size < -1:
        raise ConfigError(f"--group-size {args.group_size} is not a group size; give a positive number of input "
                          "columns, or 0 (or -1) for one scale per output channel.")
    r = quantize_run(args.ckpt, args.bits, args.group_size, args.method, args.out, args.calib_batches,
                     args.eval_batches)
    before, after = r["heldout_loss"]["before"], r["heldout_loss"]["after"]
    wb, lb = r["weight_bytes"], r["linear_bytes"]
    print(f"held-out loss: {before:.4f} -> {after:.4f} ({after - before:+.4f}) on {r['eval_tokens']:,} tokens")
    print(f"weight bytes: {wb['before']:,} -> {wb['after']:,} ({wb['before'] / wb['after']:.2f}x smaller); "
          f"block linears {lb['before']:,} -> {lb['after']:,} ({lb['before'] / lb['after']:.2f}x)")
    print(f"saved {r['method']} {r['bits']}-bit model -> {r['out']}")
    return 0


def quantize_run(ckpt: str, bits: int, group_size: int, method: str = "rtn", out: str | None = None,
                 calib_batches: int = 8, eval_batches: int | None = None) -> dict:
    """Quantize a run's model, save it, return the report (also stored in the folder's quant.json)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if is_quantized(ckpt):
        raise ConfigError(f"--ckpt {ckpt} is already a quantized model; give the run it was made from.")
    cfg, run_dir, model = load_model(ckpt, device)
    group_size = max(group_size, 0)
    out_dir = Path(out) if out else run_dir / f"quantized-w{bits}-g{group_size or 'row'}-{method}"
    if out_dir.exists():
        raise ConfigError(f"{out_dir} already exists; pass --out with a new folder.")
    data = prepare(cfg.data, cfg.model.vocab_size)
    n_eval = eval_batches or cfg.train.eval_batches or 4
    names = block_linears(model)
    before = {"weights": tensor_nbytes(model.state_dict().values()),
              "linears": tensor_nbytes(model.get_submodule(n).weight for n in names),
              "loss": heldout_loss(model, cfg, data, n_eval, device)}
    if method == "rtn":
        for n in names:
            swap_in(model, n, quantize_rtn(model.get_submodule(n).weight, bits, group_size))
    else:
        gptq_model(model, calibration(cfg, data, calib_batches, device), bits, group_size)
    quantized = [model.get_submodule(n) for n in names]
    report = {"method": method, "bits": bits, "group_size": group_size, "source": str(ckpt),
              "scheme": "asymmetric min-max grid, fp16 scales, uint8 zero points (memory/quantize.py)",
              "heldout_loss": {"before": before["loss"], "after": heldout_loss(model, cfg, data, n_eval, device)},
              "eval_tokens": n_eval * cfg.train.micro_batch * cfg.model.seq_len,
              "weight_bytes": {"before": before["weights"], "after": tensor_nbytes(model.state_dict().values())},
              "linear_bytes": {"before": before["linears"],
                               "after": tensor_nbytes(t for m in quantized for t in (m.qweight, m.scales, m.zeros))}}
    save_quantized(out_dir, model, cfg, run_dir / "tokenizer.json", report)
    return {**report, "out": str(out_dir)}


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, cfg, data, n_batches: int, device: torch.device) -> float:
    """Mean loss on the first `n_batches` validation micro-batches: training's own evaluation
    (train.evaluate, same samples for the same count), in one process."""
    c = cfg.model_copy(deep=True)
    c.train.eval_batches = n_batches
    val = Batches(data.val, c.model.seq_len, c.train.seed + 1, n_batches * c.train.micro_batch, "val")
    return evaluate(model, val, c, Runtime.single(device))


def calibration(cfg, data, n_batches: int, device: torch.device) -> list[torch.Tensor]:
    """`n_batches` micro-batches of token ids from the training split (a seed of their own)."""
    mb = cfg.train.micro_batch
    batches = Batches(data.train, cfg.model.seq_len, cfg.train.seed + 7919, n_batches * mb, "train")
    return [batches.get(0, i * mb, (i + 1) * mb, device)[0] for i in range(n_batches)]
