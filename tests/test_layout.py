"""The package layout: public names importable as before, entry points alive, no import circles.

The import graph is read from the source (module-level ``import`` / ``from`` statements only:
imports inside functions are deliberate lazy loads), so a circle is caught even where Python's
import order happens to hide it today.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dist_kernels as dk

PACKAGE_DIR = Path(dk.__file__).resolve().parent
ROOT = PACKAGE_DIR.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str) -> str:
    if level == 0:
        return target
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _module_level_imports(path: Path, known: set) -> set:
    """dist_kernels modules that ``path`` imports at module level (not inside functions)."""
    module, is_package = _module_name(path), path.name == "__init__.py"
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module or "")
            # ``from pkg import sub`` imports the submodule when ``sub`` is one
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != module)
    return found


def _import_graph() -> dict:
    paths = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    known = set(paths)
    return {name: _module_level_imports(path, known) for name, path in paths.items()}


def _find_cycle(graph: dict):
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # a package imported by its own submodule is its parent, imported first anyway
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [node])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [])
            if cycle:
                return cycle
    return None


def test_no_module_level_import_circle():
    graph = _import_graph()
    assert "dist_kernels.comm.work" in graph, sorted(graph)
    cycle = _find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_circle():
    """The checker above must be able to fail: a made-up circle is found."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_underscore_modules_at_the_top():
    private = sorted(
        p.name
        for p in PACKAGE_DIR.glob("_*.py")
        if p.name not in ("__init__.py", "__main__.py", "_version.py")
    )
    assert private == [], f"private modules belong inside their layer's package: {private}"


@pytest.mark.parametrize("name", dk.__all__)
def test_every_public_name_resolves(name):
    assert getattr(dk, name) is not None


def test_public_names_named_by_the_docs():
    assert callable(dk.pipeline.schedule_table)
    assert "rank 0" in dk.pipeline.schedule_table("1f1b", 2, 3)
    assert callable(dk.checkpoint.save) and callable(dk.checkpoint.load)
    assert dk.optim.FusedAdamW.__name__ == "FusedAdamW"
    assert callable(dk.ops.reduce_) and callable(dk.bucketing.pack)
    assert dk.Work is dk.comm.Work
    assert dk.ReduceOp.SUM is not None


@pytest.mark.parametrize("entry", ["dist_kernels.bench", "dist_kernels.info"])
def test_entry_points_answer_help(entry):
    run = subprocess.run(
        [sys.executable, "-m", entry, "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage" in run.stdout.lower()
