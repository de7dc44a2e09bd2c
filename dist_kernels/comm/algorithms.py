"""The collective algorithms of both communicators, in one table: names, codes, and what each
collective accepts on each device.

The codes are ``algo::Algorithm``'s (csrc/algorithm/collective.h). The extension exports the
same table as ``_C.ALGORITHMS`` (built from the C++ enum) and tests/test_cuda_comm_cpu.py checks
that the two agree; this module does not import ``_C``, so importing dist_kernels loads nothing
compiled.

"auto" is resolved in C++ on both devices: on shared memory by the cost model, per call
(``CpuCommunicator::resolve``, csrc/algorithm/select.cc); on CUDA as NCCL's own collective
(``NcclCommunicator::resolve`` -> ``algo::chooseOnNccl``) until ring and tree over NCCL
send/recv have been measured on a GPU.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["CODES", "ACCEPTED", "codes", "algorithm_code"]

CODES: Dict[str, int] = {"auto": 0, "ring": 1, "tree": 2, "one_shot": 3, "nccl": 4}

#: device type -> collective -> the names its ``algorithm`` argument accepts. "one_shot" is
#: shared memory's small-message exchange, "nccl" NCCL's own collective; reduce-scatter and
#: all-gather have no tree (it reduces to a root, which neither needs), and the CPU broadcast
#: takes no algorithm (its chain or tree is chosen by size).
ACCEPTED: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "cpu": {
        "all_reduce": ("auto", "ring", "tree", "one_shot"),
        "reduce_scatter": ("auto", "ring", "one_shot"),
        "all_gather": ("auto", "ring", "one_shot"),
    },
    "cuda": {
        "all_reduce": ("auto", "ring", "tree", "nccl"),
        "reduce_scatter": ("auto", "ring", "nccl"),
        "all_gather": ("auto", "ring", "nccl"),
        "broadcast": ("auto", "ring", "tree", "nccl"),
    },
}

_CODES_OF: Dict[Tuple[str, str], Dict[str, int]] = {
    (device, collective): {name: CODES[name] for name in names}
    for device, table in ACCEPTED.items()
    for collective, names in table.items()
}


def codes(device: str, collective: str) -> Dict[str, int]:
    """name -> code of what ``collective`` accepts on ``device`` (a dict lookup per call)."""
    return _CODES_OF[(device, collective)]


def algorithm_code(device: str, collective: str, algorithm: object, rank: int) -> int:
    """The code of ``algorithm`` for ``collective`` on ``device``; ``ValueError`` naming the
    rank, the collective and the accepted names otherwise."""
    code = codes(device, collective).get(algorithm) if isinstance(algorithm, str) else None
    if code is not None:
        return code
    accepted = ACCEPTED[device][collective]
    no_tree = "" if "tree" in accepted else f" ({collective} has no tree)"
    raise ValueError(
        f"[rank {rank}] {collective}: algorithm must be one of {sorted(accepted)}{no_tree}, "
        f"got {algorithm!r}"
    )
