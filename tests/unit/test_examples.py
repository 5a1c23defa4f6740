"""Every example config a user may copy validates, the offload example is the shape benchmarked, and
what the examples' comments say holds: each command names its config by its path from the repository
root, and each GiB figure is a quoted `teratrain plan` command's, which the planner still gives."""

import json
import re
from pathlib import Path

import pytest

from teratrain.cli import main
from teratrain.config import load_config
from teratrain.models.transformer import count_params

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))
# "`teratrain plan ...` says A GiB on the GPU and B GiB of pinned host memory"
PLANNED = re.compile(r"`(teratrain plan [^`]+)` says ([\d.,]+) GiB on the GPU and ([\d.,]+) GiB of pinned host memory")


def comments(path: Path) -> str:
    """The example's comment text, its lines joined (a statement may wrap)."""
    return " ".join(line.split("#", 1)[1].strip() for line in path.read_text().splitlines() if "#" in line)


def test_there_are_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    cfg = load_config(path)
    assert cfg.train.global_batch % cfg.train.micro_batch == 0


def test_offload_example_exceeds_one_gpu_with_plain_adamw():
    cfg = load_config(Path(EXAMPLES[0]).parent / "offload-10b.toml")
    n = count_params(cfg.model)["total"]
    assert 16 * n > 139.8 * 2**30  # plain mixed-precision AdamW state alone exceeds an H200


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_commands_in_comments_name_the_example_by_its_path(path):
    """Copied from the repository root, a command finds the file: examples/<name>, never <name> alone."""
    for prefix in re.findall(r"(\S*?)" + re.escape(path.name), comments(path)):
        assert prefix.endswith("examples/"), f"{path.name} names itself as {prefix}{path.name}"


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "GiB" in comments(p)], ids=lambda p: p.name)
def test_gib_figures_in_comments_are_the_planners(path, capsys, monkeypatch):
    text = comments(path)
    statements = PLANNED.findall(text)
    assert statements and text.count("GiB") == 2 * len(statements), f"{path.name}: a GiB figure not the planner's"
    monkeypatch.chdir(path.parents[1])
    for command, gpu_gib, host_gib in statements:
        assert main([*command.split()[1:], "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert (f"{plan['total'] / 2**30:,.1f}", f"{plan['host'] / 2**30:,.1f}") == (gpu_gib, host_gib), command
