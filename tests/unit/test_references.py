"""Every reference in the tree points at something that exists. Read from the files alone (tests/references.py):
README.md and the .py .md .toml .sh .txt files of docs/, examples/, teratrain/, tests/ and bench/.

(a) Paths. A run of path characters with a '/' whose first part is a folder of the repository (teratrain,
    bench, tests, docs, examples, or a folder inside teratrain/, bench/, tests/ or bench/results/) and that
    ends in a file suffix (.py .json .md .png .toml ...) or '/' is a cited path: it exists relative to the
    repository root, to the citing file's folder, or to teratrain/, bench/, tests/ or bench/results/
    (trailing punctuation stripped). Left out: placeholders (`<machine>`, `{tmp}`, `$DIR`, a glob `*`,
    the capitals NAME, FILE, N, RUN, OUT, ...), and an option's output: a path right after `--out`,
    `--plot`, `--save`, `--trace`, `--json`, `--log`, `--output`, `--dump` or a `>` redirection is what the
    command writes, not a file it reads. Outside tests/ (tests make up files and modules of their own),
    every bare `name.py` is a file of the repository, every bare recorded-result name (a `.json` name with
    h100, h200 or cpu in it) is a file in bench/results/ or tests/fixtures/, and every dotted
    `teratrain.a.b.name` names modules that exist and a name the last one holds.
(b) Anchors. Every relative markdown link of a .md file points at a file that exists and, into a .md
    page, at one of its headings (GitHub's anchors: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'); every `bench/README.md#anchor`, `README.md#anchor` or `docs/x.md#anchor` written in
    any scanned file names a heading of that page.
(c) Section names. A page followed by a quoted name (`bench/README.md, "Section"`, `bench/README.md
    ("Section")`, `README "Section"`, `README's "Section" section`, `docs/moe.md: "Section"`; the name may
    run over a comment's line break) names a heading of that page (compared by anchor; `README` is the
    front page). A page followed by a comma or colon and an unquoted name before ')' (`bench/README.md,
    Some words)`) fails: quote the heading so that it is checked.

Each test prints every offender."""

from __future__ import annotations

from pathlib import Path

from tests.references import (broken_links, broken_sections, dangling_dotted_names, dangling_file_names,
                              dangling_paths)


def report(found: list[str]) -> str:
    return f"{len(found)} dangling:\n" + "\n".join(found)


def test_cited_paths_exist():
    found = dangling_paths()
    assert not found, report(found)


def test_named_files_and_modules_exist():
    found = dangling_file_names() + dangling_dotted_names()
    assert not found, report(found)


def test_links_and_anchors_resolve():
    found = broken_links()
    assert not found, report(found)


def test_quoted_sections_are_headings():
    found = broken_sections()
    assert not found, report(found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_each_check_finds_what_dangles(tmp_path):
    """The checks on a tree made here: each bad form found, each good form passed."""
    root = _tree(tmp_path, {
        "README.md": "# Front\n\n## What composes with what\n\nSee [moe](docs/moe.md#routers), "
                     "[gone](docs/moe.md#experts), [none](docs/none.md).\n",
        "docs/moe.md": "# MoE\n\n## Routers\n\n```bash\n# not a heading\n```\n",
        "bench/README.md": "# Bench\n\n## The layout matrix\n\n"
                           "    python bench/layouts.py --out bench/results/h200/2026-01-01_new.json\n"
                           "[file](results/h200/2026-01-01_layouts.json), [old](results/moe_h200x4.json)\n",
        "bench/layouts.py": "",
        "bench/results/h200/2026-01-01_layouts.json": "{}",
        "teratrain/__init__.py": "",
        "teratrain/planner/__init__.py": "",
        "teratrain/planner/time.py": "OPS = 1\n"
            "# bench/results/h200/2026-01-01_layouts.json, bench/results/<machine>/x.json, bench/gone.py.\n"
            "# planner/time.py and planner/measure.py; teratrain.planner.time.OPS, teratrain.planner.time.GONE,\n"
            "# teratrain.planner.measure; layouts.py, config_input.py, moe_h200x4.json, ARCHITECTURE.md\n"
            "# (bench/README.md, \"The layout\n#  matrix\"), (bench/README.md, \"Determinism\"),\n"
            "# (bench/README.md, CUDA graphs), README's \"What composes with what\" section,\n"
            "# see bench/README.md#the-layout-matrix and bench/README.md#determinism.\n"
            "NOTE = \"(docs/moe.md, \\\"Routers\\\"), (docs/moe.md, \\\"Capacity\\\")\"\n",
    })
    paths = dangling_paths(root)
    assert [p.split(": ")[1].split()[0] for p in paths] == ["bench/gone.py", "planner/measure.py"], paths
    names = dangling_file_names(root) + dangling_dotted_names(root)
    assert [n.split(": ")[1].split()[0] for n in names] == ["config_input.py", "moe_h200x4.json", "ARCHITECTURE.md",
                                                           "teratrain.planner.time.GONE",
                                                           "teratrain.planner.measure"], names
    links = broken_links(root)
    assert [x.split(": ")[1].split()[0] for x in links] == [
        "(docs/moe.md#experts)", "(docs/none.md)", "bench/README.md#determinism", "(results/moe_h200x4.json)"], links
    sections = broken_sections(root)
    assert len(sections) == 3, sections
    assert '"Determinism"' in sections[0] and "Capacity" in sections[1] and "without quotes" in sections[2], sections
    assert [x.split(": ")[0] for x in sections] == ["teratrain/planner/time.py:6", "teratrain/planner/time.py:9",
                                                   "teratrain/planner/time.py:7"], sections
