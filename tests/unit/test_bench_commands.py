"""Every bench command the pages show, in the code lines and inline code of the front page, the guides and the
bench page, is accepted by its script's argument parser as written: optional parts in [brackets] included,
FILE, PREFIX and other capitals standing for the reader's own values. A renamed or removed flag fails here,
not in a reader's GPU session. (bench/results/INDEX.md's commands are left out: each is the command at its
own commit, which later code may have outgrown.) Each script runs in-process up to its parse_args and stops
there: torch is imported once for all."""

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = r"(?:torchrun|python3?) [^`\n]*?bench/\S+\.py[^`\n]*"


def shown_commands() -> list[str]:
    """The bench commands of the pages' code lines and inline code, comments cut, brackets dropped."""
    out = []
    for page in PAGES:
        text = page.read_text()
        out += re.findall(rf"^ *({COMMAND})$", text, re.M) + re.findall(rf"`({COMMAND})`", text)
    return sorted({re.sub(r"\s+#\s.*$", "", c).replace("[", "").replace("]", "").strip() for c in out})


def script_and_args(command: str) -> tuple[str, list[str]]:
    """(the bench script, its arguments) of a python or torchrun command line."""
    words = shlex.split(command)
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"bench/\S+\.py", w))
    return words[at], [CHOICES.get(w, w) for w in words[at + 1:]]


# a capital word standing for one of a positional argument's choices
CHOICES = {"PART": "memory"}  # bench/context.py PART: memory, speed, forms, scaling


class _Parsed(Exception):
    pass


COMMANDS = shown_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_shown_bench_command_parses(command, monkeypatch):
    script, args = script_and_args(command)
    assert (ROOT / script).is_file(), f"{script} does not exist"
    parse = argparse.ArgumentParser.parse_args

    def parsed(self, *a, **k):
        parse(self, *a, **k)  # an unknown flag or a bad value exits here (code 2)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))
    monkeypatch.chdir(ROOT)
    with pytest.raises(_Parsed):
        runpy.run_path(str(ROOT / script), run_name="__main__")
