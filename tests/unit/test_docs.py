"""The front page and the guides stay readable and true to the code: README.md at most 300 lines with no
table cell over 200 characters, every docs/*.md at most 400 lines, and every `teratrain` command in
their bash blocks parsed by the CLI's own parser, with its config keys and layout accepted as
`teratrain train` would accept them before starting (nothing is run). Their links, anchors and cited
paths are checked with the rest of the tree's in test_references.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from teratrain.cli import build_parser
from teratrain.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# Keys whose values name files of the reader's (a Hugging Face folder, a corpus): checked for existence
# by the loader, so a command shown with a placeholder path is validated without them.
READER_PATHS = ("model.init_from", "data.path", "data.tokenizer")


def ids(pages):
    return [p.relative_to(ROOT).as_posix() for p in pages]


def test_readme_fits_the_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the front page holds at most 300"


@pytest.mark.parametrize("page", DOCS, ids=ids(DOCS))
def test_guide_length(page):
    n = len(page.read_text().splitlines())
    assert n <= 400, f"{page.name} has {n} lines; a guide holds at most 400"


def table_cells(text: str) -> list[str]:
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            cells += [c.strip() for c in line.strip().strip("|").split("|")]
    return cells


def test_readme_table_cells_are_short():
    long = [c[:80] + "..." for c in table_cells(README.read_text()) if len(c) > 200]
    assert not long, f"README.md table cells over 200 characters: {long}"


def commands(page: Path) -> list[str]:
    """The `teratrain ...` lines of a page's bash blocks, continuation lines joined, comments cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line.startswith("teratrain "):
                out.append(line)
    return out


SHOWN = [(page, line) for page in PAGES for line in commands(page)]


def test_pages_show_commands():
    assert len(SHOWN) >= 40, len(SHOWN)
    assert {page for page, _ in SHOWN} >= {README, ROOT / "docs" / "parallelism.md", ROOT / "docs" / "runs.md"}


@pytest.mark.parametrize("page, line", SHOWN, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(SHOWN)])
def test_shown_command_is_accepted(page, line, monkeypatch):
    from teratrain.mesh import ParallelDims
    from teratrain.parallel.support import check_supported
    from teratrain.train import check_batch

    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(shlex.split(line)[1:])  # an unknown flag or command exits here
    if args.command not in ("train", "plan"):
        return
    sets = [s for s in args.overrides if not s.startswith(READER_PATHS)]
    if args.command == "plan":
        sets = [s for s in sets if not s.startswith("model.preset=")]
        sets += [f"model.preset={args.model}"] if args.model else []
    config = args.config if args.config and args.config.endswith(".toml") else None  # not a HF config.json
    if config and not config.startswith("examples/"):
        config = None  # the reader's own file (my.toml)
    if args.command == "train" and args.resume:
        config = None  # the run's own saved config
    cfg = load_config(config, sets)  # an unknown key or a bad value fails here
    if args.command == "plan" or cfg.parallel.auto:
        return  # the planner chooses the layout
    world = args.nproc or 1
    dims = ParallelDims.from_config(cfg.parallel, world)
    check_supported(cfg)
    check_batch(cfg, dims.dp)
