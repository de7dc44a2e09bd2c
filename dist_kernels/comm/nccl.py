"""Finds and loads NCCL at run time (design decision 3); the C++ side is csrc/transport/nccl_loader.

Search order, first hit wins:

1. ``DK_NCCL_LIBRARY``: an absolute path to ``libnccl.so*``. When set it is the only candidate:
   a relative or missing path is an error, never silently skipped.
2. The ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels: ``nvidia/nccl/lib/libnccl.so.2`` in
   any directory of the ``nvidia`` namespace package (found through importlib; nothing from
   torch.cuda is imported, so no CUDA context is created).
3. The libnccl that this process already mapped (torch's CUDA build loads one), read from
   ``/proc/self/maps``.

Loading happens once per process; every later call returns the same library.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, List, Optional, Tuple

from .. import _C

ENV_VAR = "DK_NCCL_LIBRARY"
#: Where the NCCL wheels put the library, relative to a directory of the ``nvidia`` package.
WHEEL_RELATIVE_PATHS = ("nccl/lib/libnccl.so.2", "cu13/lib/libnccl.so.2", "cu12/lib/libnccl.so.2")
#: Read for step 3; a module variable so that tests can point it at a fake maps file.
MAPS_PATH = "/proc/self/maps"


def _wheel_candidates() -> List[str]:
    """``libnccl.so.2`` paths under every directory of the ``nvidia`` namespace package."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [
        os.path.join(os.path.abspath(root), rel)
        for root in spec.submodule_search_locations
        for rel in WHEEL_RELATIVE_PATHS
    ]


def _mapped_candidates() -> List[str]:
    """Absolute paths of ``libnccl.so*`` files mapped into this process."""
    try:
        with open(MAPS_PATH) as maps:
            lines = maps.readlines()
    except OSError:
        return []
    found: List[str] = []
    for line in lines:
        fields = line.split(None, 5)  # address perms offset device inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and os.path.basename(path).startswith("libnccl.so"):
            if path not in found:
                found.append(path)
    return found


def candidates() -> List[Tuple[str, str]]:
    """Every ``(source, path)`` in search order, existing or not.

    Raises ``ValueError`` when ``DK_NCCL_LIBRARY`` is set to a relative or missing path.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        if not os.path.isabs(override):
            raise ValueError(f"{ENV_VAR}={override!r} must be an absolute path to libnccl.so")
        if not os.path.isfile(override):
            raise ValueError(f"{ENV_VAR}={override!r}: no such file")
        return [(ENV_VAR, override)]
    found = [("nvidia-nccl wheel", path) for path in _wheel_candidates()]
    found += [("loaded by this process", path) for path in _mapped_candidates()]
    return found


def load() -> Tuple[str, str]:
    """Loads NCCL (once per process) and returns ``(path, version)``.

    Raises ``RuntimeError`` listing every path tried, with why each failed, when none loads;
    ``ValueError`` for a bad ``DK_NCCL_LIBRARY``.
    """
    loaded = _C.nccl_loaded()
    if loaded is not None:
        return loaded
    tried: List[str] = []
    for source, path in candidates():
        if not os.path.isfile(path):
            tried.append(f"  {path} ({source}): not found")
            continue
        try:
            return path, _C.nccl_load(path)
        except (RuntimeError, ValueError) as error:
            if source == ENV_VAR:
                raise RuntimeError(f"{ENV_VAR}: {error}") from None
            tried.append(f"  {path} ({source}): {error}")
    listing = "\n".join(tried) or "  (no candidate: no nvidia package, no libnccl mapped)"
    raise RuntimeError(
        "NCCL not found. Set DK_NCCL_LIBRARY to an absolute path to libnccl.so.2, or "
        "pip install nvidia-nccl-cu12 (or -cu13). Tried:\n" + listing
    )


def describe() -> Dict[str, Optional[str]]:
    """``{"nccl_library": path or None, "nccl_version": "2.x.y" or None}``; never raises."""
    try:
        path, version = load()
    except Exception:  # describe() feeds build_info(): report "not found", never fail
        return {"nccl_library": None, "nccl_version": None}
    return {"nccl_library": path, "nccl_version": version}
