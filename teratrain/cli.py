"""Command line: `teratrain train | generate | tokenize | quantize | export` (and `plan`, see teratrain.planner).

Bad input exits with status 2 and one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path

from teratrain import __version__, jobenv
from teratrain.checkpoint import CheckpointError
from teratrain.config import ConfigError, load_config
from teratrain.config_toml import describe
from teratrain.data.corpus import DataError
from teratrain.jobenv import rank, under_launcher, under_torchrun
from teratrain.launch import (Stopped, error_file, follow_parent, launch, record_failure, stop_on_signals,
                              stopped_message, write_report)
from teratrain.parallel import inflight

USER_ERRORS = (ConfigError, DataError, CheckpointError)
# errors of the machine, not of teratrain: a sentence, not a traceback
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_bare_resume(sys.argv[1:] if argv is None else argv))
    with stop_on_signals() as stopping:
        try:
            return args.func(args)
        except BaseException as e:  # noqa: BLE001 - every way out is decided in one place
            stopping["ending"] = True  # the launcher's SIGTERM must not interrupt the report of `e`
            return _exit_status(e, stopping["signum"], training=args.func is cmd_train)


def _exit_status(e: BaseException, signum: int | None, training: bool = True) -> int:
    """How a command that raised ends: one line (or none on ranks that are not rank 0, or under the
    launcher, which reports for the job) and its exit status. Only a bug shows a traceback."""
    if isinstance(e, SystemExit):
        raise e
    if isinstance(e, KeyboardInterrupt):  # SIGINT raised before our handler was installed
        e = Stopped(signal.SIGINT)
    if signum is not None and not isinstance(e, Stopped):  # e.g. a collective broken by the stop
        e = Stopped(signum)
    if isinstance(e, Stopped):
        write_report("signal", signal.Signals(e.signum).name)
        if rank() == 0 and not under_launcher():
            print(stopped_message(e.signum, getattr(e, "run_dir", None)) if training
                  else f"teratrain: stopped by {signal.Signals(e.signum).name}.", file=sys.stderr)
        return e.exit_code
    if under_torchrun() and (lost := inflight.lost_peer(e)) is not None:
        record_failure(lost, "".join(traceback.format_exception(e)))
        print(f"teratrain: error: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # at once: the teardown of a group whose peer is gone can take seconds, in which torchrun would
        # take this rank for a healthy one; status 1 lets torchrun restart the job when it may
        os._exit(1)
    if isinstance(e, BrokenPipeError):  # e.g. `teratrain plan | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    sentence = str(e) if isinstance(e, USER_ERRORS) else _disk_sentence(e)
    if sentence is not None:
        write_report("user", sentence)
        if under_torchrun():
            error_file(sentence)
        if not under_launcher():
            print(f"teratrain: error: {sentence}", file=sys.stderr)
        return 2
    if under_launcher():
        first = str(e).splitlines()[0] if str(e) else ""
        write_report("crash", f"{type(e).__name__}: {first}" if first else type(e).__name__, e)
        return 1
    raise e


def _disk_sentence(e: BaseException) -> str | None:
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        where = f" {e.filename}" if e.filename else ""
        return (f"cannot write{where} ({e.strerror}); free some space or point --out / data.cache_dir at a "
                "writable folder with room.")
    return None


def _bare_resume(argv: list[str]) -> list[str]:
    """`--resume` takes an optional `auto`: a bare one followed by anything else (a config file) is kept
    bare, not read as its value."""
    return [f"{a}=yes" if a == "--resume" and (i + 1 == len(argv) or argv[i + 1] != "auto") else a
            for i, a in enumerate(argv)]


def _resume_value(text: str) -> bool | str:
    if text not in ("auto", "yes"):
        raise argparse.ArgumentTypeError(f"got {text!r}; give --resume alone, or --resume auto")
    return text == "yes" or text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="teratrain", description="Train large transformers on many GPUs.")
    parser.add_argument("--version", action="version", version=f"teratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: the tiny preset on the Python stdlib corpus)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--out", help="run directory (default runs/<timestamp>)")
    t.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    t.add_argument("--nproc", type=int, help="launch N local processes through torchrun (default 1; with --resume, "
                                             "as many as the run's checkpoint was written by)")
    t.add_argument("--resume", nargs="?", const=True, type=_resume_value, metavar="auto",
                   help="continue from the newest usable checkpoint of --out; `--resume auto`: if --out holds one, "
                        "else start the run there (checkpoint.resume; the default under plain torchrun)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    t.add_argument("--print-config", action="store_true",
                   help="print the config that would run (file, preset, --set, a resumed run's own) and exit")
    t.add_argument("--auto-note", help=argparse.SUPPRESS)  # from the launcher to its ranks: parallel.auto's choice
    t.add_argument("--resume-note", help=argparse.SUPPRESS)  # from the launcher to its ranks: what resume=auto did
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("--ckpt", required=True, help="run directory (or one of its checkpoint folders)")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=int,
                   help="tokens to generate (default: 200, or as many as the model's context holds)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    from teratrain.data.tokenize import add_tokenize_parser

    add_tokenize_parser(sub)
    from teratrain.quantize import add_quantize_parser

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
    """--set items plus --steps; a flag does not silently replace (and so hide) a --set of the same key."""
    if args.steps is None:
        return list(args.overrides)
    if any(o.partition("=")[0].strip() == "train.steps" for o in args.overrides):
        raise ConfigError("--steps and --set train.steps both set train.steps; give only one of them.")
    return list(args.overrides) + [f"train.steps={args.steps}"]


def cmd_train(args) -> int:
    from teratrain import rundir

    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} is not a process count; give --nproc 1 or more.")
    given = args.resume if args.resume is not None else _resume_key(args)
    launched = bool(args.resume) if under_launcher() else None
    mode, resume, resume_note, run_dir = rundir.decide_resume(given, args.out, launched, args.resume_note)
    jobenv.run_dir = run_dir
    if resume:
        cfg = rundir.resume_config(run_dir, args.config, _overrides(args),
                                   replan=bool(args.nproc) and args.nproc != rundir.processes(run_dir))
    else:
        cfg = load_config(args.config, _overrides(args))
    if mode == "auto" and run_dir is not None:
        rundir.check_same_run(run_dir, cfg)
    nproc = args.nproc or (rundir.processes(run_dir) if resume else 1)
    launching = nproc > 1 and "WORLD_SIZE" not in os.environ
    world = nproc if launching else int(os.environ.get("WORLD_SIZE", "1"))
    notes, auto_sets = [args.auto_note] if args.auto_note else [], []
    if cfg.parallel.auto and not args.auto_note:  # the ranks of a launch get the launcher's choice
        from teratrain.planner.auto import for_job

        choice = for_job(cfg, world, world if launching else int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        notes, auto_sets = [choice.note], choice.sets()
    if args.print_config:
        print(describe(cfg))
        return 0
    if resume:
        _check_batch_kept(cfg, world, run_dir)
    _check_before_start(cfg, world)
    start_over = mode == "auto" and not resume
    if launching:
        with rundir.own(run_dir or rundir.fresh_run_dir(), resume, created=run_dir is None, start_over=start_over) as d:
            argv = _rank_argv(args, d, resume, auto_sets, notes)
            argv += ["--resume-note", resume_note] if resume_note else []
            return launch(argv, nproc, d, cfg.checkpoint.stop_timeout_s)
    from teratrain.train import run

    follow_parent()
    owner = rank() == 0 and not under_launcher()  # one process per job holds the run directory
    if owner:
        run_dir = run_dir or rundir.fresh_run_dir()
    try:
        with rundir.own(run_dir, resume, created=not args.out and not resume, start_over=start_over) if owner \
                else nullcontext(), rundir.member(run_dir, defer=not owner and not under_launcher()):
            summary = run(cfg, run_dir, resume, notes=notes + ([resume_note] if resume_note else []))
    except Stopped as e:
        e.run_dir = run_dir  # for the message: where to resume from
        raise
    from teratrain.mesh import shutdown

    shutdown()  # before exit: a process group still referenced is freed in teardown, where its threads abort
    if rank() == 0:
        ev = summary.get("eval_loss")
        print(f"done: {summary['step']} steps, loss {summary['loss']:.4f}"
              + (f", eval loss {ev:.4f}" if ev is not None else "")
              + f", {summary['tokens_per_s']:,.0f} tokens/s -> {summary['run_dir']}")
    return 0


def _resume_key(args) -> bool | str | None:
    """checkpoint.resume as the config file and --set give it (before the rest of the config is read:
    it decides which config that is, the file's or the run's own)."""
    from teratrain.config import apply_overrides, read_toml, validate

    raw = apply_overrides(read_toml(args.config) if args.config else {}, args.overrides)
    given = raw.get("checkpoint", {}).get("resume") if isinstance(raw.get("checkpoint"), dict) else None
    return validate({"checkpoint": {"resume": given}}).checkpoint.resume


def _check_batch_kept(cfg, world: int, run_dir: Path) -> None:
    """A run resumed at another data-parallel degree (torchrun restarted it on another number of nodes)
    keeps its global batch, with as many micro-batches per rank as it takes; refuse, in one sentence,
    a degree over which it does not split."""
    from teratrain import rundir
    from teratrain.mesh import ParallelDims

    dp, saved = ParallelDims.from_config(cfg.parallel, world).dp, rundir.processes(run_dir)
    gb, mb = cfg.train.global_batch, cfg.train.micro_batch
    now = f"at dp={dp} on {world} processes (its checkpoint: {saved})"
    if gb % dp:
        raise ConfigError(f"the run in {run_dir} resumes {now}, over which its train.global_batch={gb} does not "
                          f"split; resume on a number of processes whose data-parallel degree divides {gb}.")
    if gb // dp % mb:
        raise ConfigError(f"the run in {run_dir} resumes {now}, where each rank takes {gb // dp} of its "
                          f"train.global_batch={gb} sequences, not a multiple of train.micro_batch={mb}; set "
                          f"train.micro_batch to a divisor of {gb // dp} (the global batch stays {gb}).")


def _check_before_start(cfg, world: int) -> None:
    """Fail in one line before any process starts or any memory is taken: the layout, the batch,
    the GPU count, and whether the model's states fit in this machine's memory."""
    import torch

    from teratrain.mesh import ParallelDims
    from teratrain.parallel.support import check_supported
    from teratrain.startup import check_host_memory
    from teratrain.train import check_batch

    dims = ParallelDims.from_config(cfg.parallel, world)  # a bad layout fails here, in one line
    check_supported(cfg)
    check_batch(cfg, dims.dp)
    gpus = torch.cuda.device_count()
    if "LOCAL_RANK" not in os.environ and cfg.train.device != "cpu" and gpus and world > gpus:
        raise ConfigError(f"--nproc {world} asks for more processes than the {gpus} visible GPUs; use --nproc {gpus} "
                          "or set train.device=cpu.")
    on_cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    check_host_memory(cfg, dims.workers, int(os.environ.get("LOCAL_WORLD_SIZE", world)), on_cpu)


def _rank_argv(args, run_dir: Path, resume: bool, auto_sets: list[str] = (), notes: list[str] = ()) -> list[str]:
    """This command as each rank runs it, with the run directory the launcher chose and owns, whether
    it resumes there (as checkpoint.resume decided in the launcher), and the layout parallel.auto
    chose there (so every rank runs the same one without planning again)."""
    argv = ["train"] + ([args.config] if args.config else [])
    argv += [x for o in _overrides(args) + list(auto_sets) for x in ("--set", o)]
    argv += [x for note in notes[:1] for x in ("--auto-note", note)]
    return argv + ["--out", str(run_dir)] + (["--resume"] if resume else [])


def cmd_generate(args) -> int:
    from teratrain.generate import generate

    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0),
                             ("--temperature", args.temperature, 0)):
        if value is not None and not value >= low:  # NaN too
            raise ConfigError(f"{flag} must be at least {low}, got {value}; give a value >= {low}.")

    text = generate(args.ckpt, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
