"""Failures that end in one sentence and exit 2 (not a traceback, not silence); the smaller
command-line contracts (--steps vs --set, strict TOML types, --nproc, --print-config, --version)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from teratrain.config import tomllib  # tomli on Python 3.10
from tests.helpers import TINY_SETS, flip_byte
from tests.integration.runner import assert_user_error, latest_checkpoint, metrics


def test_steps_flag_does_not_hide_an_invalid_set(cli, tmp_path):
    proc = cli("train", "--out", tmp_path / "run", "--set", "train.steps=many", "--steps", "1", expect_rc=None,
               in_process=True)
    assert_user_error(proc, "--steps", "train.steps")


def test_a_toml_string_is_not_a_number(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nsteps = "100"\n')
    assert_user_error(cli("train", bad, "--out", tmp_path / "run", expect_rc=None, in_process=True),
                      "train.steps", "integer", "'100'")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_must_be_positive(cli, tmp_path, n):
    assert_user_error(cli("train", "--out", tmp_path / "run", "--nproc", n, expect_rc=None, in_process=True), "--nproc")
    assert not (tmp_path / "run").exists()


def test_print_config_shows_what_would_run(cli, tmp_path):
    cfg_file = tmp_path / "my.toml"
    cfg_file.write_text("[train]\nglobal_batch = 64\n")
    out = cli("train", cfg_file, "--set", "model.preset=gpt2-124m", "--set", "optim.lr=1e-4", "--print-config",
              in_process=True).stdout
    cfg = tomllib.loads(out)
    assert cfg["train"]["global_batch"] == 64 and cfg["optim"]["lr"] == 1e-4
    assert cfg["model"]["preset"] == "gpt2-124m" and cfg["model"]["d_model"] == 768 and cfg["model"]["arch"] == "gpt2"
    assert "# optim.lr" not in out and "peak learning rate" in out  # keys carry their descriptions as comments


def test_version(cli):
    proc = cli("--version", in_process=True)
    assert proc.stdout.startswith("teratrain ") and proc.stdout.split()[1][0].isdigit()


def test_model_too_big_for_host_memory_is_refused_before_building(cli, tmp_path):
    """llama-70b's fp32 parameters, gradients and AdamW state (~1 TiB) on the CPU: refused from the
    plan, before a byte is allocated, instead of ending in the OOM killer."""
    proc = cli("train", "--out", tmp_path / "run", "--set", "model.preset=llama-70b", "--set", "train.device=cpu",
               "--steps", "1", expect_rc=None, in_process=True)
    assert_user_error(proc, "host memory", "GiB", "parallel.zero=3")
    assert not (tmp_path / "run").exists()


def _read_only_dir(tmp_path):
    """(a folder no file can be created in, the command prefix to run in it) or a skip."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return folder, []
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("root ignores permissions and no mount namespace is available for a read-only mount")
    mount = f"mount -t tmpfs -o ro,size=1m none {folder} && exec \"$@\""
    return folder, ["unshare", "-m", "sh", "-c", mount, "sh"]


@pytest.mark.skipif(sys.platform != "linux", reason="read-only mount / permissions as on Linux")
def test_read_only_out(cli, tmp_path):
    folder, prefix = _read_only_dir(tmp_path)
    argv = [sys.executable, "-m", "teratrain", "train", "--out", str(folder / "run"), "--steps", "1",
            *[a for s in TINY_SETS for a in ("--set", s)]]
    proc = subprocess.run(prefix + argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_user_error(proc, str(folder / "run"), "writable")


@pytest.mark.long
@pytest.mark.slow
def test_full_disk_during_a_save(cli, tmp_path):
    """A file-size limit makes the checkpoint write fail half-way, as a full disk does: one sentence,
    the partial .tmp folder removed, and the previous checkpoint still resumable."""
    run = tmp_path / "run"
    cli.train(run, "checkpoint.every=2", "train.eval_batches=0", steps=2)
    limit = (run / "checkpoints" / "step_00000002" / "rank00000.safetensors").stat().st_size // 2

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv = [sys.executable, "-m", "teratrain", "train", "--out", str(run), "--steps", "4", "--resume",
            *[a for s in [*TINY_SETS, f"data.cache_dir={json.dumps(cli.cache)}"] for a in ("--set", s)]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert line.startswith("teratrain: error: could not write checkpoint step_00000004") and "--resume" in line
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert latest_checkpoint(run).name == "step_00000002"
    cli.train(run, steps=4, resume=True)  # with room again, it continues from step 2
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_every_checkpoint_corrupt_advises_a_fix_that_works(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        flip_byte(ckpt / "rank00000.safetensors")
    line = assert_user_error(cli.train(run, steps=60, resume=True, expect_rc=None, in_process=True),
                             "no usable checkpoint", f"delete {run} to")
    assert "train without --resume" not in line
    shutil.rmtree(run)  # the advice (the folder's metrics of the lost steps go with it)
    cli.train(run, "train.eval_batches=0", steps=1)


@pytest.mark.long
@pytest.mark.slow
def test_pruning_after_a_fallback_keeps_the_good_checkpoint(cli, tmp_path):
    """checkpoint.every=0 saves only at the end: after resuming from step 2 past a corrupt step 4, the
    save at step 6 must keep step 2 (good) rather than step 4 (corrupt), which is set aside."""
    run = tmp_path / "run"
    cli.train(run, "checkpoint.every=2", "train.eval_batches=0", steps=4)
    flip_byte(run / "checkpoints" / "step_00000004" / "rank00000.safetensors")
    proc = cli.train(run, "checkpoint.every=0", steps=6, resume=True)
    assert "resuming from step_00000002" in proc.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_00000002", "step_00000004.unusable", "step_00000006"]


def test_an_edited_rank_json_is_reported_as_changed(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    rank_json = run / "checkpoints" / "step_00000050" / "rank00000.json"
    rank_json.write_text(json.dumps(json.loads(rank_json.read_text()), indent=2))  # still valid JSON
    flip_byte(run / "checkpoints" / "step_00000025" / "rank00000.safetensors")  # nothing to fall back to
    line = assert_user_error(cli.train(run, steps=60, resume=True, expect_rc=None, in_process=True))
    assert "step_00000050: rank00000.json was changed after it was written" in line
    assert "missing" not in line


def test_generate_says_what_does_not_fit_the_context(cli, trained_run):
    proc = cli("generate", "--ckpt", trained_run, "--prompt", "x = 1\n" * 40, "--max-new-tokens", 100,
               "--temperature", 0, in_process=True)
    assert "model.seq_len" in proc.stderr and "only its last 63 tokens" in proc.stderr
    assert "generating at most 1" in proc.stderr


def test_generate_with_its_defaults_does_not_warn(cli, trained_run):
    """The default length fills the context (64 tokens here) instead of warning that 200 do not fit."""
    proc = cli("generate", "--ckpt", trained_run, "--prompt", "def main(", "--temperature", 0, in_process=True)
    assert proc.stderr == "" and len(proc.stdout) > len("def main(")


def test_generate_errors_advise_generate_flags(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        flip_byte(ckpt / "rank00000.safetensors")
    line = assert_user_error(cli("generate", "--ckpt", run, expect_rc=None, in_process=True), "--ckpt")
    assert "--resume" not in line and "--out" not in line
    assert (run / "checkpoints" / "step_00000050").is_dir(), "generate reads; it does not set checkpoints aside"


def test_generate_with_a_garbled_tokenizer(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert_user_error(cli("generate", "--ckpt", run, expect_rc=None, in_process=True), "tokenizer.json", "unreadable")
