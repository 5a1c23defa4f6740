"""The project speaks of itself only: no words of how its work was organised (numbered rounds and
calls of work, tracker item numbers, how machines were obtained, scratch paths, before/after/run2
variants) in the code, the tests, the benchmarks, the docs or the examples, nor in their file names.

`offences(root)` scans a checkout (README.md, docs/, examples/, teratrain/, tests/, bench/; text
files .py .md .toml .sh .json .txt) and returns one line per offence. Words used in their ordinary
sense pass: only a numbered one trips (a Python session, a `--rounds` option or a count of kernels a
step does not). This file, which lists the patterns, is exempt; its examples are assembled from pieces
(`_w`) so that its own text holds none of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AREAS = ("README.md", "docs", "examples", "teratrain", "tests", "bench")
TEXT = {".py", ".md", ".toml", ".sh", ".json", ".txt"}
SKIP = {".venv", ".git", "runs", "__pycache__", ".pytest_cache"}
SELF = Path("tests/unit/test_project_words.py")

_N = r"\d+"
_MORE = rf"(?:\s*(?:-|–|,|and|to)\s*{_N})*"  # "5-6", "2, 3 and 4"
PATTERNS = [(re.compile(p, re.IGNORECASE), what) for p, what in (
    (rf"\bsessions?[\s_-]*{_N}", "a numbered session of work"),
    (rf"\bsessions?\s+{_N}\s*(?:-|to|and)\s*{_N}", "numbered sessions of work"),
    (r"\b(?:this|next|last|previous|that) session\b", "a session of work"),
    (rf"\bcalls?\s+{_N}{_MORE}\b(?!\s*(?:times|x)\b)", "a numbered call of work"),
    (rf"\bcall{_N}_|_call{_N}\b|_s{_N}call{_N}", "a call of work in a name"),
    (rf"\bissue\s*#?{_N}\b", "a tracker item number"),
    (rf"\bissues\s+#?{_N}\s*(?:-|–|to|and)\s*#?{_N}\b", "tracker item numbers"),
    (rf"(?:\(|\b(?:see|for|fixes|fixed|fix|in|of|by|PR)\s+)#{_N}\b", "a tracker item number"),
    (rf"(?<!-)\brounds?\s+{_N}{_MORE}\b(?!\s*(?:decimal|digit|place|times)s?\b)(?!\s*[.,]\d)", "a numbered round of work"),
    (r"\b(?:this|next|last|previous) round\b", "a round of work"),
    (r"\bleas(?:e|es|ed)\b|\blent\b", "how a machine was obtained"),
    (r"(?<![\w/.])scratch/", "a scratch path outside the repository"),
    (rf"_session{_N}", "a session of work in a name"),
)]
NAME = re.compile(r"run2|_before|_after|session|call\d|s\d+call", re.IGNORECASE)


def _files(root: Path):
    for area in AREAS:
        top = root / area
        if top.is_file():
            yield top
        elif top.is_dir():
            for path in sorted(top.rglob("*")):
                if path.is_file() and not SKIP & set(path.relative_to(root).parts):
                    yield path


def offences(root: Path) -> list[str]:
    """'file:line: text  <- what' for every process word in the text files of `root`'s areas, and
    'file: file name  <- ...' for every file whose name carries one."""
    out = []
    for path in _files(root):
        rel = path.relative_to(root)
        if rel == SELF:
            continue
        if NAME.search(path.name):
            out.append(f"{rel}: file name  <- a round of work or a variant in a file name")
        if path.suffix not in TEXT:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        if "\0" in text:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for pattern, what in PATTERNS:
                m = pattern.search(line)
                if m:
                    out.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}  <- {what}")
                    break
    return out


@pytest.fixture(scope="module")
def found_here() -> list[str]:
    return offences(ROOT)


@pytest.mark.parametrize("area", AREAS)
def test_the_tree_speaks_of_itself_only(area, found_here):
    found = [o for o in found_here if o.startswith(area)]
    files = sorted({o.split(":")[0] for o in found})
    assert not found, f"{len(found)} process words in {len(files)} files: {files}\n" + "\n".join(found[:60])


def _w(*pieces: str) -> str:
    """A phrase assembled from pieces, so this file's text never holds the phrase itself."""
    return "".join(pieces)


SES, CAL, ISS, LEA, RND = _w("ses", "sion"), _w("ca", "ll"), _w("iss", "ue"), _w("lea", "se"), _w("rou", "nd")


def test_the_scanner_finds_each_kind_of_offence(tmp_path):
    (tmp_path / "teratrain").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    lines = [f"measured in {SES} 17 on 2 GPUs", f"see {SES}s 13 and 15", f"({CAL}s 5-6)", f"as in {CAL} 4's run",
             f"{ISS} 22's targets", _w("the fix for #", "18"), f"a fresh {LEA}", _w("no machine was le", "nt"),
             _w("scr", "atch/probe.py"), f"gpu_suite_s5{CAL}1.log", f"h200x2-{SES}15", f"this {SES}'s runs",
             f"{RND} 3 of the work"]
    (tmp_path / "teratrain" / "x.py").write_text("\n".join(f"# {line}" for line in lines) + "\n")
    (tmp_path / "bench" / "results" / "determinism_h200_run2.json").write_text("{}")
    (tmp_path / "bench" / "results" / "step_before.json").write_text("{}")
    found = offences(tmp_path)
    assert [o.split(":")[1] for o in found if o.startswith("teratrain")] == [str(i) for i in range(1, len(lines) + 1)]
    names = [o for o in found if "file name" in o]
    assert len(names) == 2 and all(o.startswith("bench/results/") for o in names)


def test_ordinary_words_pass(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("\n".join([
        f"start a Python {SES} and {CAL} it 3 times", f"`bench/fsdp2_compare.py --{RND}s 3`", f"{RND}s 1.066, 1.067",
        f"It {ISS}s 9,700 kernels a step", "a hang in torch (pytorch#115388)", 'edgecolor="#444"', "release the lock",
        "an equivalent layout", "a relaunch of the host-paced rows", f"{RND} 2 decimal places", f"def {SES}(self):",
        f"the planner {ISS}s 12 collectives", f"{CAL}s the hook", f"{RND}-trip through TOML", "--out /scratch/runs/big",
        '"name": "llama-1b #1 dp=4 tp=1"', "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}"]) + "\n")
    (tmp_path / "docs" / "runs.md").write_text("fine\n")
    assert offences(tmp_path) == []
