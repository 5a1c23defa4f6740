"""Bad input exits 2 with one line `teratrain: error: ...` that names the key, never a traceback.

Errors found before training starts run in-process (`teratrain.cli.main`, no interpreter start-up);
the entry point itself (`python -m teratrain`) is exercised by the subprocess cases at the end.
"""

import shutil

import pytest

from tests.helpers import flip_byte, truncate
from tests.hf_models import save_llama
from tests.integration.runner import assert_user_error, metrics


BAD_SETTINGS = [
    (["model.d_modle=64"], ["model.d_modle", "did you mean 'model.d_model'"]),
    (["train.seed=abc"], ["train.seed", "integer"]),
    (["model.n_heads=5"], ["model.n_heads", "model.d_model"]),
    (["model.n_kv_heads=3"], ["model.n_kv_heads", "model.n_heads"]),
    (["model.preset=llama-2b"], ["model.preset", "llama-1b"]),
    (["train.global_batch=10"], ["train.global_batch", "train.micro_batch"]),
    (["optim.lr_scaling=linear"], ["optim.base_batch"]),
    (["trainn.steps=3"], ["trainn"]),
    (["parallel.tp=2"], ["parallel.tp"]),
    (["lora.rank=4", "parallel.pp=2"], ["lora.rank=4", "parallel.pp=1"]),
    (["lora.rank=200"], ["lora.rank=200", "not be low-rank"]),
    (["data.eot_id=5000"], ["data.eot_id=5000", "model.vocab_size=4096"]),
    (['data.sources=[{path="nope.jsonl", weight=1}]'], ["data.sources[0].path", "does not exist"]),
]


@pytest.mark.parametrize("sets, words", [pytest.param(s, w, id=s[0]) for s, w in BAD_SETTINGS])
def test_bad_setting(cli, tmp_path, sets, words):
    assert_user_error(cli.train(tmp_path / "run", *sets, steps=2, expect_rc=None, in_process=True), *words)
    assert not (tmp_path / "run").exists(), "a rejected config must not leave a half-made run directory"


def test_missing_config_file(cli, tmp_path):
    proc = cli("train", tmp_path / "nope.toml", "--out", tmp_path / "run", expect_rc=None, in_process=True)
    assert_user_error(proc, "nope.toml", "does not exist")


def test_broken_toml(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = \n")
    proc = cli("train", bad, "--out", tmp_path / "run", expect_rc=None, in_process=True)
    assert_user_error(proc, "bad.toml", "TOML")


def test_wrong_type_in_a_toml_file(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nn_layers = "two"\n')
    proc = cli("train", bad, "--out", tmp_path / "run", expect_rc=None, in_process=True)
    assert_user_error(proc, "model.n_layers", "integer")


def test_resume_with_nothing_to_resume(cli, tmp_path):
    proc = cli.train(tmp_path / "fresh", steps=2, resume=True, expect_rc=None, in_process=True)
    assert_user_error(proc, "no usable checkpoint", "--resume")


def test_resume_with_a_different_model_is_refused(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    proc = cli.train(run, "model.n_layers=3", steps=60, resume=True, expect_rc=None, in_process=True)
    assert_user_error(proc, "model.n_layers", "same model shape")


def test_resume_with_a_different_optimizer_is_refused(cli, trained_run, tmp_path):
    """An AdamW checkpoint holds no SGD momentum: resuming it as SGD is refused with a sentence. (Another
    precision, ZeRO stage or process count carries over: tests/integration/test_cli_reshard.py.)"""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    proc = cli.train(run, "optim.warmup_steps=10", "metrics.peak_tflops=1", "optim.name=sgd", steps=52, resume=True,
                     expect_rc=None, in_process=True)
    assert_user_error(proc, "optim.name", "same setting")


def test_generate_from_a_missing_run(cli, tmp_path):
    proc = cli("generate", "--ckpt", tmp_path / "nope", expect_rc=None, in_process=True)
    assert_user_error(proc, "--ckpt", "does not exist")


# ---- through `python -m teratrain`

def test_entry_point_exits_2_without_traceback(cli, tmp_path):
    proc = cli.train(tmp_path / "run", "model.d_modle=64", steps=2, expect_rc=None)
    assert_user_error(proc, "model.d_modle", "did you mean 'model.d_model'")
    assert proc.stdout == ""


def test_resume_without_out_and_no_runs(cli, tmp_path):
    proc = cli.train(None, steps=2, resume=True, cwd=tmp_path, expect_rc=None)
    assert_user_error(proc, "--resume", "--out")


def test_resume_from_a_run_whose_checkpoints_are_all_corrupt(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        flip_byte(ckpt / "rank00000.safetensors")
    proc = cli.train(run, "optim.warmup_steps=10", "checkpoint.every=25", "metrics.peak_tflops=1", steps=60,
                     resume=True, expect_rc=None)
    line = assert_user_error(proc, "no usable checkpoint", "step_00000050", "step_00000025")
    assert "sha256" in line


def test_resume_of_a_finished_run_says_so(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    proc = cli.train(run, steps=50, resume=True, expect_rc=None, in_process=True)
    assert_user_error(proc, "already reached step 50", "--steps")


@pytest.mark.parametrize("flag, value", [("--top-k", "-1"), ("--max-new-tokens", "-5"), ("--temperature", "-0.5"),
                                         ("--temperature", "nan")])
def test_generate_rejects_out_of_range_flags(cli, trained_run, flag, value):
    proc = cli("generate", "--ckpt", trained_run, "--prompt", "x", flag, value, expect_rc=None, in_process=True)
    assert_user_error(proc, flag)


def test_out_that_is_a_file(cli, tmp_path):
    (tmp_path / "afile").write_text("")
    assert_user_error(cli.train(tmp_path / "afile", steps=1, expect_rc=None, in_process=True), "is a file")


def test_fresh_run_into_a_finished_run_is_refused(cli, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    proc = cli.train(run, steps=2, expect_rc=None, in_process=True)
    assert_user_error(proc, "already holds a run", "--resume")
    assert (run / "checkpoints" / "step_00000050").exists(), "the old run's checkpoints must survive"


def test_unwritable_cache_dir(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = cli("train", "--out", tmp_path / "run", "--set", f"data.cache_dir=\"{blocker / 'sub'}\"",
               expect_rc=None, in_process=True)
    assert_user_error(proc, "data.cache_dir")


def test_bin_with_a_broken_sidecar(cli, tmp_path):
    import numpy as np

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    (tmp_path / "tok.json").write_text("{bad")
    proc = cli.train(tmp_path / "run", f"data.path=\"{tmp_path / 'tok.bin'}\"", steps=1, expect_rc=None, in_process=True)
    assert_user_error(proc, "tok.json")


def test_an_empty_bin_is_one_sentence(cli, tmp_path):
    (tmp_path / "tok.bin").write_bytes(b"")
    proc = cli.train(tmp_path / "run", f"data.path=\"{tmp_path / 'tok.bin'}\"", steps=1, expect_rc=None,
                     in_process=True)
    assert_user_error(proc, "tok.bin", "is empty")


def test_truncated_hf_weights_are_one_sentence(cli, tmp_path):
    """In one process (under --nproc the launcher already said it in one line, but with exit 1)."""
    pytest.importorskip("transformers")
    save_llama(tmp_path / "hf", vocab_size=4096)  # the cached tokenizer's size
    truncate(tmp_path / "hf" / "model.safetensors")
    proc = cli("train", "--out", tmp_path / "run", "--steps", 1, "--set", f"model.init_from={str(tmp_path / 'hf')!r}",
               "--set", f"data.cache_dir={cli.cache!r}", expect_rc=None, in_process=True)
    assert_user_error(proc, "model.safetensors", "truncated")


def test_a_run_stopped_before_its_first_checkpoint_is_not_reused(cli, tmp_path):
    """Its folder holds logged steps but nothing to resume: a fresh run there would silently mix two
    runs' metrics; it is refused, and so is --resume, each with the fix."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n')
    assert_user_error(cli.train(run, steps=1, expect_rc=None, in_process=True), "before its first checkpoint", "delete")
    assert (run / "metrics.jsonl").read_text().startswith('{"step": 1')
    assert_user_error(cli.train(run, steps=1, resume=True, expect_rc=None, in_process=True), f"delete {run}")


def test_a_diverged_run_ends_on_every_rank_in_one_sentence(cli, tmp_path):
    """A loss that is not finite ends the run at that step on every rank (they agree, so none waits in a
    collective), with the step and the learning rate named, and no checkpoint of those weights."""
    run = tmp_path / "run"
    proc = cli.train(run, "optim.lr=1e30", "checkpoint.every=100", steps=20, nproc=2, expect_rc=None)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("teratrain: error: the loss became nan at step") and "lower optim.lr" in last, last
    assert not list(run.glob("checkpoints/step_*"))
    assert len(metrics(run)) == int(last.split("at step ")[1].split()[0])  # the diverged step is logged
