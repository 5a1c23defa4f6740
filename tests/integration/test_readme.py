"""The README's commands run as written: its quick tour in order (in a temporary folder, with the files it
names made there), the mixture-of-experts guide's first example (docs/moe.md) and the README's example
of a bad key with the exact line it shows. Only the size is changed: every `teratrain train` that
starts a run gets the tiny test shape (tests/helpers.py TINY_SETS) and a few steps (`--steps` values
map in order to 2, 3, 4; none given: 2)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from teratrain.data.tokenizer import train_bpe
from tests.hf_models import save_llama
from tests.helpers import TINY_SETS
from tests.integration.runner import metrics

README = Path(__file__).resolve().parents[2] / "README.md"
MOE_GUIDE = README.parent / "docs" / "moe.md"
pytestmark = pytest.mark.slow


def readme_block(after_heading: str, page: Path = README) -> list[str]:
    """The commands (`teratrain ...` lines, comments cut) of the first ```bash block under a heading."""
    text = "\n" + page.read_text()
    section = text[text.index(f"\n{after_heading}\n"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [re.sub(r"\s+#\s.*$", "", ln).strip() for ln in block.splitlines() if ln.startswith("teratrain ")]


def tiny(argv: list[str], cache: str, steps: dict[str, str]) -> list[str]:
    """`argv` at the test size: a fresh `train` gets the tiny shape, and its --steps a small count."""
    argv = [steps.get(a, a) if i and argv[i - 1] == "--steps" else a for i, a in enumerate(argv)]
    if argv[0] != "train" or "--print-config" in argv or "--resume" in argv:
        return argv
    sets = [*TINY_SETS, "train.eval_batches=1", f"data.cache_dir={json.dumps(cache)}"]
    return argv + (["--steps", "2"] if "--steps" not in argv else []) + [a for s in sets for a in ("--set", s)]


def run(cli, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    if "--nproc" in argv:  # the launcher starts processes: not inside the test process
        proc = subprocess.run([sys.executable, "-m", "teratrain", *argv], cwd=cwd, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (argv, proc.stderr)
        return proc
    return cli(*argv, in_process=True)


def test_quick_tour(cli, tmp_path, monkeypatch):
    commands = [shlex.split(c)[1:] for c in readme_block("## Quick tour")]
    counts = sorted({int(c[c.index("--steps") + 1]) for c in commands if "--steps" in c})
    steps = {str(n): str(i + 2) for i, n in enumerate(counts)}
    (tmp_path / "my.toml").write_text((README.parent / "examples" / "tiny-cpu.toml").read_text())
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(500)))
    hf = tmp_path / "path" / "to" / "hf-model"  # the tiny shape, with its own tokenizer
    save_llama(hf, vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
    train_bpe([corpus], 300, hf / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        proc = run(cli, tiny(argv, cli.cache, steps), tmp_path)
        assert "Traceback" not in proc.stderr and "warning" not in proc.stderr, (argv, proc.stderr)
    assert [r["step"] for r in metrics(tmp_path / "runs" / "a")] == [1, 2, 3, 4]
    assert (tmp_path / "hf" / "my-model" / "config.json").is_file()
    assert len(list((tmp_path / "runs").iterdir())) == 5  # runs/a and four of default names


def test_moe_example(cli, tmp_path):
    (line,) = [c for c in readme_block("# Mixture of experts", MOE_GUIDE) if "switch-top1" in c]
    argv = tiny(shlex.split(line)[1:] + ["--out", str(tmp_path / "run")], cli.cache, {})
    cli(*argv, in_process=True)
    assert metrics(tmp_path / "run")[-1]["moe"]


def test_bad_key_example_prints_what_the_readme_shows(cli):
    text = README.read_text()
    shown = text[text.index("$ teratrain train --set model.n_layer=4"):].splitlines()[:2]
    proc = cli(*shlex.split(shown[0])[2:], expect_rc=2, in_process=True)
    assert proc.stderr.strip() == shown[1]
