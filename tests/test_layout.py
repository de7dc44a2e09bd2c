"""The package layout: public names importable as before, entry points alive, no import circles,
and engine parts that do not reach back into the engine holding them.

The import graph is read from the source (module-level ``import`` / ``from`` statements only:
imports inside functions are deliberate lazy loads), so a circle is caught even where Python's
import order happens to hide it today. A circle no import shows (a part calling back into its
owner) is caught by walking the objects a live engine's parts hold.
"""

import ast
import collections
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from mp_pool import run_ranks

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
    from dist_kernels.amp import bucketing  # where the planner and kernels used to live

    assert bucketing.pack is dk.buckets.pack and bucketing.plan_buckets is dk.bucketing.plan_buckets
    assert dk.Work is dk.comm.Work
    assert dk.ReduceOp.SUM is not None


@pytest.mark.parametrize("entry", ["dist_kernels.bench", "dist_kernels.info"])
def test_entry_points_answer_help(entry):
    run = subprocess.run(
        [sys.executable, "-m", entry, "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage" in run.stdout.lower()


# ----------------------------------------------------------------------------- parts and owners


def _reaches(start, target) -> bool:
    """Whether ``start`` holds ``target`` through what it keeps: instance attributes, slots,
    containers, bound methods, closures and live weak references (a callback into the owner
    counts). Tensors are data (their autograd hooks belong to whoever registered them), and
    classes, modules and functions' globals are shared by everything, so the walk stops there."""
    stack, seen = [start], set()
    while stack:
        obj = stack.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, torch.Tensor)):
            continue
        seen.add(id(obj))
        stack.extend(_held_by(obj))
    return False


def _held_by(obj) -> list:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return list(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):
        return _cell_contents(obj.__closure__ or ())
    if isinstance(obj, weakref.ref):
        return [obj()]
    held = [vars(obj)] if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        held += [getattr(obj, name, None) for name in getattr(cls, "__slots__", ())]
    return held


def _cell_contents(cells) -> list:
    contents = []
    for cell in cells:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return contents


def test_the_walk_finds_an_owner_reached_back():
    """The check below must be able to fail: parts that call back into their owner are found."""

    class Owner:
        def __init__(self):
            self.part = Part(self.callback)
            self.closure_part = Part(lambda: self)

        def callback(self):
            pass

    class Part:
        def __init__(self, call):
            self.calls = [call]

    owner = Owner()
    assert _reaches(owner.part, owner) and _reaches(owner.closure_part, owner)
    assert not _reaches(Part(print), owner)


def _engine_parts_reach_their_owner() -> dict:
    dk.init(device="cpu")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ddp = dk.DDP(module, bucket_cap_mb=0.0002, first_bucket_mb=0.0001, find_unused_parameters=True)
    ddp(torch.randn(4, 8)).sum().backward()  # the first backward re-plans the buckets
    ddp.register_comm_hook(None, dk.ddp_hooks.bf16_compress_hook)
    ddp(torch.randn(4, 8)).sum().backward()
    ddp_parts = {"reducer": ddp.reducer, "backward": ddp._backward, "uneven": ddp._uneven}
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = dk.ShardedOptimizer(plain.parameters(), stage=3, module=plain, lr=0.1)
    plain(torch.randn(4, 8)).sum().backward()
    opt.step()
    zero_parts = {"reducer": opt.reducer, "gatherer": opt._gatherer}
    out = {f"ddp {n}": _reaches(part, ddp) for n, part in ddp_parts.items()}
    out.update({f"zero {n}": _reaches(part, opt) for n, part in zero_parts.items()})
    out["ddp reaches its reducer"] = _reaches(ddp, ddp.reducer)  # the walk does walk
    ddp.close()
    opt.close()
    return out


def test_engine_parts_hold_no_reference_to_their_owner():
    """DDP's reducer, backward side and uneven-inputs part, ZeRO's reducer and stage-3 gatherer
    (style habit 11: a part gets what it needs at construction or in a call)."""
    for rank, result in enumerate(run_ranks(2, _engine_parts_reach_their_owner, timeout=120)):
        print(f"rank {rank}: {result}")
        assert result.pop("ddp reaches its reducer")
        assert not any(result.values()), result
