"""Command line: `teratrain train | generate | quantize | export` (and `plan`, see teratrain.planner).

Bad input exits with status 2 and one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from teratrain.checkpoint import CheckpointError
from teratrain.config import ConfigError, describe, load_config
from teratrain.data.corpus import DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"teratrain: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `teratrain plan | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("teratrain: interrupted; the last complete checkpoint is intact (resume with --resume)", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="teratrain", description="Train large transformers on many GPUs.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: the tiny preset on the Python stdlib corpus)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--out", help="run directory (default runs/<timestamp>)")
    t.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    t.add_argument("--nproc", type=int, default=1, help="launch N local processes through torchrun")
    t.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint of --out")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    t.add_argument("--print-config", action="store_true", help="print every config key with its default and exit")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("--ckpt", required=True, help="run directory (or one of its checkpoint folders)")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    from teratrain.memory.ptq import add_quantize_parser

    add_quantize_parser(sub)

    from teratrain.checkpoint.hf_export import add_export_parser

    add_export_parser(sub)
    try:
        from teratrain.planner.cli import add_plan_parser
    except ImportError:  # the planner is optional in a partial install
        pass
    else:
        add_plan_parser(sub)
    return parser


def _overrides(args) -> list[str]:
    extra = [f"train.steps={args.steps}"] if args.steps is not None else []
    return list(args.overrides) + extra


def cmd_train(args) -> int:
    if args.print_config:
        print(describe())
        return 0
    cfg = load_config(args.config, _overrides(args))  # validate before launching anything
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from teratrain.mesh import ParallelDims
        from teratrain.parallel.parallelize import check_supported
        from teratrain.train import check_batch, check_out

        dims = ParallelDims.from_config(cfg.parallel, args.nproc)  # a bad layout fails here, in one line
        check_supported(cfg)
        check_batch(cfg, dims.dp)
        check_gpus(cfg, args.nproc)
        if args.out:
            check_out(args.out, args.resume)
        return launch(args)
    from teratrain.train import run

    summary = run(cfg, args.out, args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        ev = summary.get("eval_loss")
        print(f"done: {summary['step']} steps, loss {summary['loss']:.4f}"
              + (f", eval loss {ev:.4f}" if ev is not None else "")
              + f", {summary['tokens_per_s']:,.0f} tokens/s -> {summary['run_dir']}")
    return 0


def launch(args) -> int:
    """Re-run this command under torchrun with N local processes. torchrun stops the whole job when
    one rank fails and reports that rank's error; we pass its exit status on."""
    from datetime import datetime

    argv = _reconstruct(args)
    if args.out or not args.resume:  # --resume alone: rank 0 finds the newest run and tells the others
        argv += ["--out", args.out or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "teratrain", *argv]
    rc = subprocess.call(cmd)
    if rc:
        print(f"teratrain: error: a rank of the {args.nproc}-process job failed (exit status {rc}); its own "
              "message is above torchrun's report.", file=sys.stderr)
    return rc


def check_gpus(cfg, nproc: int) -> None:
    """One process per GPU: more processes than visible GPUs cannot start."""
    import torch

    gpus = torch.cuda.device_count()
    if cfg.train.device != "cpu" and gpus and nproc > gpus:
        raise ConfigError(f"--nproc {nproc} asks for more processes than the {gpus} visible GPUs; use --nproc {gpus} "
                          "or set train.device=cpu.")


def _reconstruct(args) -> list[str]:
    argv = ["train"] + ([args.config] if args.config else [])
    argv += [x for o in _overrides(args) for x in ("--set", o)]
    return argv + (["--resume"] if args.resume else [])


def cmd_generate(args) -> int:
    from teratrain.generate import generate

    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0),
                             ("--temperature", args.temperature, 0)):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}; give a value >= {low}.")

    text = generate(args.ckpt, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
