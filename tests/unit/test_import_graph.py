"""The import graph of teratrain/, read from the source with ast: no module imports itself through
others (no circle), the planner reads the engines' rules without importing the engines, and models/
never imports torch.distributed.

Every `import` and `from ... import` of a teratrain module counts, at module level or inside a
function: a lazy import that closes a circle still makes one, it only hides it until the call.
Importing `a.b.c` from outside package `a.b` also runs `a.b`'s __init__ (and `a`'s), so those count
as edges too; a module inside the package finds it already started, so for it they do not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "teratrain"

# The modules that run training (collectives, process groups, update engines, the pipeline executor):
# the planner reads their rules from the plans and checks they share (parallel/tp_plan.py,
# ep_plan.py, support.py, buckets.py, flat.py, pipeline/split.py, ...), never these.
ENGINES = {f"teratrain.parallel.{m}" for m in (
    "zero", "zero_gather", "zero_fp8", "zero_state", "data", "sync", "param_server", "tensor", "tp_layers",
    "tp_overlap",
    "expert", "expert_dedup", "ep_pipeline", "parallelize", "comm", "inflight", "pipeline.runtime", "pipeline.p2p",
    "pipeline.timing", "context",
    "ring_attention")}
ENGINES |= {"teratrain.mesh", "teratrain.launch"}
# compat.py, the torch-version shim, names torch's flat collectives at import (no process group, no
# call): the one module outside parallel/ that models/ and the planner reach which imports torch.distributed.
DIST_SHIM = "teratrain.compat"
MODEL_DEPENDENCIES = {"teratrain.config_base", "teratrain.config_model", DIST_SHIM}


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every .py file under `root` (a package dir)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imported(name: str, is_pkg: bool, node: ast.AST) -> list[str]:
    """Absolute names `node` imports (a `from x import y` names x.y too: y may be a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the importing module's package, up level - 1 packages
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{a.name}" for a in node.names]


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, the other modules each imports by name)."""
    mods = modules(root)
    top = root.name
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if is_pkg:
            own_packages.add(name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(name, is_pkg, node):
                if target != top and not target.startswith(top + "."):
                    external[name].add(target)
                    continue
                while target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                runs = [".".join(parts[:i]) for i in range(2, len(parts))] + [target]  # parents' __init__ first
                edges[name] |= {m for m in runs if m in mods and m not in own_packages and m != name}
    return edges, external


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def reach(edges: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or through others: name -> the chain that gets there."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for n in sorted(edges[m]):
            if n not in chains:
                chains[n] = chains[m] + [n]
                todo.append(n)
    return chains


def test_the_import_graph_has_no_circle():
    edges, _ = graph()
    assert len(edges) > 100, "the package was not found"
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_planner_never_imports_an_engine():
    edges, external = graph()
    for name in [m for m in edges if m.startswith("teratrain.planner")]:
        for m, chain in reach(edges, name).items():
            assert m not in ENGINES, f"{' -> '.join(chain)}: the planner reaches an engine"
            dist = {x for x in external[m] if x.startswith("torch.distributed")}
            assert not dist or m == DIST_SHIM, f"{' -> '.join(chain)} imports {sorted(dist)}"


def test_models_never_import_torch_distributed():
    edges, external = graph()
    for name in [m for m in edges if m.startswith("teratrain.models")]:
        for m, chain in reach(edges, name).items():
            dist = {x for x in external[m] if x.startswith("torch.distributed")}
            assert not dist or m == DIST_SHIM, f"{' -> '.join(chain)} imports {sorted(dist)}"
            assert m.startswith("teratrain.models") or m in MODEL_DEPENDENCIES, \
                f"{' -> '.join(chain)}: models/ reaches beyond the model, its config section and compat"


def test_the_graph_sees_lazy_relative_and_package_imports(tmp_path):
    """The checks can fail: a circle closed by a function-level relative import, and one through a
    package's __init__, are both found."""
    pkg = tmp_path / "teratrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from teratrain import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "sub" / "__init__.py").write_text("from teratrain.sub.x import y\n")
    (pkg / "sub" / "x.py").write_text("from teratrain.c import z\n")
    (pkg / "c.py").write_text("import torch.distributed as dist\nfrom teratrain.sub.x import w\n")
    edges, external = graph(pkg)
    assert find_cycle({m: e for m, e in edges.items() if m in ("teratrain.a", "teratrain.b")}) == \
        ["teratrain.a", "teratrain.b", "teratrain.a"]
    assert "teratrain.sub" in edges["teratrain.c"]  # importing teratrain.sub.x runs teratrain.sub first
    assert "teratrain.sub" not in edges["teratrain.sub.x"]  # from inside the package it has started
    assert find_cycle({m: e - {"teratrain.a", "teratrain.b"} for m, e in edges.items()
                       if m not in ("teratrain.a", "teratrain.b")}) is not None
    assert "torch.distributed" in external["teratrain.c"]


def test_reading_a_config_imports_no_torch():
    """`teratrain.config` (the TOML, --set and validation of every key) loads without torch: a tool that
    only reads or checks configs starts in a fifth of a second, not in one and a half."""
    import subprocess
    import sys

    code = "import sys, teratrain.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_starting_a_run_imports_no_dynamo():
    """torch._dynamo takes about two seconds to import and only a compiled run needs it: the CLI and the
    training loop load without it (ring attention is wrapped in torch.compiler.disable where a ring core
    is built, not where it is defined), so every `teratrain` process and every spawned rank starts sooner."""
    import subprocess
    import sys

    code = "import sys, teratrain.cli, teratrain.train; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
