"""`teratrain generate` samples a continuation from a trained run."""

import pytest

from tests.integration.runner import latest_checkpoint

PROMPT = "def main("

pytestmark = pytest.mark.slow


def test_generate_prints_the_prompt_and_a_continuation(cli, trained_run):
    proc = cli("generate", "--ckpt", trained_run, "--prompt", PROMPT, "--max-new-tokens", 20)
    assert proc.stdout.startswith(PROMPT)
    assert len(proc.stdout.rstrip("\n")) > len(PROMPT), "something must be generated after the prompt"
    assert "Traceback" not in proc.stderr


def test_generate_is_reproducible_by_seed_and_accepts_a_checkpoint_folder(cli, trained_run):
    def gen(ckpt, seed):
        return cli("generate", "--ckpt", ckpt, "--prompt", PROMPT, "--max-new-tokens", 30, "--seed", seed,
                   "--temperature", 1.0, in_process=True).stdout

    a = gen(trained_run, 1)
    assert a == gen(latest_checkpoint(trained_run), 1)  # the run's latest checkpoint, named directly
    assert a != gen(trained_run, 2)


def test_greedy_generation_from_an_older_checkpoint(cli, trained_run):
    older = trained_run / "checkpoints" / "step_00000025"
    out = cli("generate", "--ckpt", older, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", 10,
              in_process=True).stdout
    assert out.startswith(PROMPT)
    assert out != cli("generate", "--ckpt", trained_run, "--prompt", PROMPT, "--temperature", 0,
                      "--max-new-tokens", 10, in_process=True).stdout, "step 25 and step 50 weights differ"
