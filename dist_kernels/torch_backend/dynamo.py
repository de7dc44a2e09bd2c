"""Keeps torch.compile's frame evaluator (dynamo) out of this backend's Python frames.

torch's own process groups are C++: code that torch.compile runs eagerly around a graph break
(torch DDP's forward calls its C++ reducer there, which broadcasts through the group) never
enters Python inside them. Ours is Python, and dynamo tries to compile every Python frame that
starts while a compiled function runs. It cannot: in torch 2.13 a ProcessGroup is an opaque
object to dynamo, so reading our group's attributes is a hard error
(``UnsafeScriptObjectError: ... Member '_fast_broadcast' is not registered``), and
``torch.compile(DDP(model))`` failed at its first forward.

So every function of these modules is marked, once at import, to be skipped by dynamo together
with every frame it calls (torch's ``FrameAction.SKIP`` for the frame and recursively, the
strategy torch gives its own ``torch._dynamo.disable(recursive=True)``, set on the code objects
so that no wrapper runs per call). Without dynamo nothing reads the mark. On a torch without
this private hook the marking does nothing.
"""

from __future__ import annotations

import types
from typing import Any, Iterator


def skip_module(module: types.ModuleType) -> None:
    """Marks the functions and the methods of the classes ``module`` defines, and the code
    nested in them (closures, lambdas)."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    except (ImportError, AttributeError, TypeError):  # a torch without this private hook
        return
    for code in _codes(module):
        set_code_exec_strategy(code, strategy)


def _codes(module: types.ModuleType) -> Iterator[types.CodeType]:
    seen = set()
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported names belong to their own modules
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            for fn in _functions(member):
                for code in _nested(fn.__code__):
                    if code not in seen:
                        seen.add(code)
                        yield code


def _functions(member: Any) -> Iterator[types.FunctionType]:
    """The functions behind a function, method, property or decorator (``__wrapped__``)."""
    if isinstance(member, property):
        parts = (member.fget, member.fset, member.fdel)
    elif isinstance(member, (staticmethod, classmethod)):
        parts = (member.__func__,)
    else:
        parts = (member,)
    for fn in parts:
        while isinstance(fn, types.FunctionType):
            yield fn
            fn = getattr(fn, "__wrapped__", None)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)
