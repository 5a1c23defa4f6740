"""What the tree's text points at, read from the files alone (nothing imported, nothing run): the repository
paths it cites, the markdown links and `page.md#anchor` pointers, and the quoted section names after a page
(`bench/README.md, "Section"`). tests/unit/test_references.py holds every one of them to what exists.

Scanned: README.md and the text files (.py .md .toml .sh .txt) of docs/, examples/, teratrain/, tests/ and
bench/; recorded results (.json) are data and are not read."""

from __future__ import annotations

import bisect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AREAS = ("README.md", "docs", "examples", "teratrain", "tests", "bench")
TEXT = {".py", ".md", ".toml", ".sh", ".txt"}
SKIP = {".venv", ".git", "runs", "__pycache__", ".pytest_cache"}
# The checker and its test write out the forms they look for, as examples.
SELF = {"tests/references.py", "tests/unit/test_references.py"}
FENCE = re.compile(r"```.*?```", re.S)


def text_files(root: Path = ROOT) -> list[Path]:
    """The scanned files of a checkout at `root`, in AREAS order."""
    out = []
    for area in AREAS:
        top = root / area
        if top.is_file():
            out.append(top)
        elif top.is_dir():
            out += [p for p in sorted(top.rglob("*")) if p.is_file() and p.suffix in TEXT
                    and not SKIP & set(p.relative_to(root).parts) and rel(p, root) not in SELF]
    return out


def rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# --- headings and anchors -------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but '-' and '_'), spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings (of any level; code blocks' '#' lines are no headings)."""
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*#*$", text, flags=re.M)}


# --- (a) repository paths --------------------------------------------------------------------------------

# A path is a run of path characters with a '/' whose first part is a folder of the repository (a top
# folder, or a folder inside teratrain/, bench/ or tests/, for paths written relative to those) and whose
# end is a file with one of these suffixes, or a folder with a trailing '/'.
SUFFIXES = ("py", "json", "jsonl", "md", "png", "toml", "sh", "txt", "csv", "log")
PATH = re.compile(r"(?<![\w./\-<>{}*$~])((?:[\w.\-<>{}*]+/)+(?:[\w.\-<>{}*]+\.(?:%s)\b|(?=[\s`'\"),;:]|$)))"
                  % "|".join(SUFFIXES))
# A value an option writes (the command's output, not a file of the repository) and a shell redirection.
OUTPUT = re.compile(r"(?:--(?:out|out-dir|output|plot|save|trace|dump|json|log)[= ]\s*|>\s*)$")
# Names that stand for a value: `<machine>`, `{name}`, `$DIR`, a glob, and the capitals NAME, FILE, N, ...
PLACEHOLDER = re.compile(r"[<>{}*$]|(?:^|/)(?:NAME|FILE|N|DIR|RUN|OUT|PATH|RESULT|MACHINE|DATE|BENCH)(?:\.\w+)?(?:/|$)")


# Folders a path may be written relative to: the package's own modules, the benchmarks, the tests, and the
# recorded results (`h200x4/2026-11-26_layouts.json`).
BASES = ("teratrain", "bench", "tests", "bench/results")


def folders(root: Path = ROOT) -> set[str]:
    """First parts a cited path may start with: the areas, and the folders one level inside BASES."""
    out = {a for a in AREAS if (root / a).is_dir()}
    for area in BASES:
        if (root / area).is_dir():
            out |= {p.name for p in (root / area).iterdir() if p.is_dir() and p.name not in SKIP}
    return out


def resolves(cited: str, source: Path, root: Path = ROOT) -> bool:
    """A cited path exists relative to the repository root, to the citing file's folder or to one of BASES."""
    cited = cited.rstrip("/")
    return any((base / cited).exists() for base in [root, source.parent, *(root / b for b in BASES)])


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(offset, path) for each repository-looking path in `text`, outputs and placeholders left out."""
    out = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if OUTPUT.search(text[max(0, m.start() - 20):m.start()]) or PLACEHOLDER.search(path):
            continue
        if text[max(0, m.start() - 2):m.start()] == "](":
            continue  # a markdown link's target: broken_links checks it, relative to its page
        out.append((m.start(), path))
    return out


def dangling_paths(root: Path = ROOT) -> list[str]:
    """'file:line: path  <- no such file' for every cited path that resolves nowhere."""
    first_parts = folders(root)
    out = []
    for file in text_files(root):
        text = file.read_text()
        for pos, path in cited_paths(text):
            if path.split("/")[0] in first_parts and not resolves(path, file, root):
                out.append(f"{rel(file, root)}:{line_of(text, pos)}: {path}  <- no such file")
    return out


# Bare file names (`engine.py`) and dotted names (`teratrain.parallel.tp_plan.check_tp`) are checked
# where the reader meets them: the pages, the examples, the package and the benchmarks. Tests make up
# modules and files of their own (in temporary folders), so tests/ is left out of these two checks.
NAMED_IN = ("README.md", "docs", "examples", "teratrain", "bench")
# Files outside the repository that the text names by their name alone.
OUTSIDE_FILES = {"sitecustomize.py", "file.py"}  # Python's start-up hook; a profiler frame's form
RECORDED = re.compile(r"(?:^|_)(?:h100|h200|cpu)(?:x\d+)?(?:_|\.json$)")


def _named_in(root: Path) -> list[Path]:
    return [f for f in text_files(root) if rel(f, root).split("/")[0] in NAMED_IN]


def dangling_file_names(root: Path = ROOT) -> list[str]:
    """Each bare `name.py` or `name.md` is the name of a file of the repository, and each bare name of a
    recorded result (a `.json` name with a machine in it: h100, h200, cpu) the name of a file in
    bench/results/ or tests/fixtures/."""
    files = {p.name for area in AREAS if (root / area).exists()
             for p in ([root / area] if (root / area).is_file() else (root / area).rglob("*"))}
    recorded = {p.name for top in ("bench/results", "tests/fixtures") if (root / top).is_dir()
                for p in (root / top).rglob("*.json")}
    out = []
    for file in _named_in(root):
        text = file.read_text()
        for m in re.finditer(r"(?<![\w./\-<>{}*])([A-Za-z_][\w\-]*\.(py|md|json))\b", text):
            name, suffix = m.groups()
            if suffix in ("py", "md") and name not in files | OUTSIDE_FILES:
                out.append(f"{rel(file, root)}:{line_of(text, m.start())}: {name}  <- no file of that name")
            elif suffix == "json" and RECORDED.search(name) and name not in recorded:
                out.append(f"{rel(file, root)}:{line_of(text, m.start())}: {name}  <- no recorded result of that name")
    return out


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def defines(source: str, name: str) -> bool:
    """Whether a module's source binds `name`: a def, a class, an assignment or field, an import, or a key
    of a lazy export table (`"run": "teratrain.train"`)."""
    n = re.escape(name)
    return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b|^\s*{n}\s*[:=]|^\s*(?:\w+\s*,\s*)+{n}\s*="
                          rf"|\bimport\s+(?:\([^)]*)?[^\n]*\b{n}\b|\bas\s+{n}\b|^\s+{n},?\s*\)?$"
                          rf"|[\"']{n}[\"']\s*:", source, re.M))


def dangling_dotted_names(root: Path = ROOT) -> list[str]:
    """Each `teratrain.a.b.name` names modules that exist and, past the last module, a name its source
    holds (a function, a class, a constant or an import)."""
    out = []
    for file in _named_in(root):
        text = file.read_text()
        for m in re.finditer(r"(?<![\w.])teratrain(?:\.[A-Za-z_]\w*)+\b(?!\.\d)", text):
            parts = m.group(0).split(".")
            n = len(parts)
            while n > 1 and _module_file(root, parts[:n]) is None:
                n -= 1
            source = _module_file(root, parts[:n])
            if n < len(parts) and not defines(source.read_text(), parts[n]):
                out.append(f"{rel(file, root)}:{line_of(text, m.start())}: {m.group(0)}  <- "
                           f"{'.'.join(parts[:n])} has no {parts[n]}")
    return out


# --- (b) links and anchors -------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A page#anchor written in text (a comment, a docstring): relative to the repository root.
POINTER = re.compile(r"(?<![\w/.])((?:\.\./)*(?:bench/README\.md|README\.md|docs/[\w\-]+\.md))#([\w\-]+)")


def broken_links(root: Path = ROOT) -> list[str]:
    """Every relative markdown link of a .md file to a file that exists and, into a .md page, to one of
    its headings; every page#anchor pointer in any scanned file to a heading of that page."""
    out = []
    for file in text_files(root):
        text = file.read_text()
        if file.suffix == ".md":
            prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
            for m in LINK.finditer(prose):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):  # http(s), mailto
                    continue
                path, _, anchor = target.partition("#")
                page = (file.parent / path).resolve() if path else file
                why = None
                if not page.exists():
                    why = "no such file"
                elif anchor and page.suffix == ".md" and anchor not in anchors(page):
                    why = "no such heading"
                if why:
                    out.append(f"{rel(file, root)}:{line_of(prose, m.start())}: ({target})  <- {why}")
        for m in POINTER.finditer(text):
            page = root / m.group(1).lstrip("./")
            if file.suffix == ".md" and text[max(0, m.start() - 2):m.start()] == "](":
                continue  # a markdown link, checked above relative to its page
            if not page.exists() or m.group(2) not in anchors(page):
                out.append(f"{rel(file, root)}:{line_of(text, m.start())}: {m.group(0)}  <- no such heading")
    return out


# --- (c) quoted section names --------------------------------------------------------------------------

PAGE = r"(?<![\w/\"'])(?P<page>bench/README\.md|README(?:\.md)?|docs/[\w\-]+\.md)(?!\"|'(?!s\b))"
# `bench/README.md, "Section"`, `bench/README.md ("Section")`, `README "Section"`, `README's "Section"
# section`, `docs/moe.md: "Section"`, and the same with escaped quotes inside a Python string; the name may
# run over a line break of a comment or docstring.
SECTION = re.compile(PAGE + r"(?:'s)?\s*[,:(]?\s*(?:sections?\s+)?\\?[\"“](?P<title>[^\"”\\]{2,120})\\?[\"”]")
# `bench/README.md, Some words)`: a section named without quotes cannot be checked; quote it.
UNQUOTED = re.compile(PAGE + r"(?:'s)?\s*[,:]\s+(?P<title>[A-Za-z][^\"“()\n]{0,60}?)\)")


def _joined(text: str, suffix: str) -> tuple[str, list[int]]:
    """The text with each line break and the next line's indentation (and its '#' in Python) one space,
    so that a name split over two lines of a comment reads whole; and where each line starts in it."""
    marker = r"\s*#?\s*" if suffix == ".py" else r"\s*"
    parts, starts, last = [], [0], 0
    for m in re.finditer(r"\n" + marker, text):
        parts.append(text[last:m.start()] + " ")
        starts += [sum(map(len, parts))] * m.group(0).count("\n")  # blank lines are joined too
        last = m.end()
    return "".join(parts) + text[last:], starts


def page_of(name: str, source: Path, root: Path = ROOT) -> Path:
    """The page a pointer names: `README` is the front page, but inside bench/'s own pages bench/README.md."""
    if name.startswith(("bench/", "docs/")):
        return root / name
    if source.suffix == ".md" and source.parent == root / "bench":
        return source.parent / "README.md"
    return root / "README.md"


def broken_sections(root: Path = ROOT) -> list[str]:
    """'file:line: pointer  <- ...' for every quoted section name that is no heading of its page, and for
    every section named without quotes."""
    out = []
    for file in text_files(root):
        text, starts = _joined(file.read_text(), file.suffix)
        where = lambda m: f"{rel(file, root)}:{bisect.bisect_right(starts, m.start())}"  # noqa: E731
        for m in SECTION.finditer(text):
            page = page_of(m.group("page"), file, root)
            if slug(m.group("title")) not in anchors(page):
                out.append(f"{where(m)}: {m.group(0)!r}  <- {rel(page, root)} has no such heading")
        for m in UNQUOTED.finditer(text):
            out.append(f"{where(m)}: {m.group(0)!r}  <- a section named without quotes")
    return out
