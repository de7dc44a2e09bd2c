"""The alpha-beta cost model: one alpha (per dependent step) and beta (per byte) per link,
fitted by measurement, pricing every algorithm; ``auto`` picks by it.

Links: shared memory (per host size: a host with more ranks than cores pays more per step)
and each inter-host engine (Gloo, MPI). An algorithm's time is ``steps * alpha + bytes *
beta`` with its steps and bytes from :func:`terms` (the table of design.md; shared memory's
built-in constants live in ``csrc/algorithm/select.cc``, and ``--calibrate`` replaces them
for this machine). A hierarchical collective (:mod:`~dist_kernels.comm.hierarchical`) is
priced stage by stage: per chunk of ``s = S / K`` bytes, its shared-memory stages (one after
another on the host's queue) and its network stage; with K chunks pipelined::

    T(K) = shm(s) + net(s) + (K - 1) * max(shm(s), net(s))

where the R cross groups run at once, so ``net`` counts the bytes of all R on the wire. Flat
(one Gloo collective over all n ranks) is priced as a ring of n on the inter-host link.

The fitted parameters live in a JSON file (``DK_COST_MODEL``, default
``~/.cache/dist_kernels/cost_model.json``), written by ``python -m dist_kernels.bench
--calibrate``; rank 0 of each hierarchical communicator reads it and shares it, so every rank
decides alike.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

#: Inter-host defaults until --calibrate measures them, from a loaded run of
#: benchmarks/bench_multihost.py (2 emulated hosts x 1 rank, uncapped, load average ~15,
#: benchmarks/results/2026-12-01-multihost-loaded.md): an 8 B all-reduce (2 steps) took
#: ~200 us on Gloo and ~40 us on MPICH, 64 MiB ~124 ms on both (S bytes on the wire each way).
DEFAULT_INTER = {
    "gloo": {"alpha_us": 100.0, "beta_us_per_byte": 1.0 / 540.0},
    "mpi": {"alpha_us": 20.0, "beta_us_per_byte": 1.0 / 540.0},
}
HIERARCHY_KINDS = ("auto", "flat", "replicated", "multi_leader")
ENGINE_CHOICES = ("auto", "gloo", "mpi")
MAX_CHUNKS = 64
MIN_CHUNK_BYTES = 16 << 10  # smaller chunks add a step per chunk and gain nothing (measured)


@dataclass(frozen=True)
class Link:
    """One kind of step: ``alpha_us`` per dependent step, ``beta_us_per_byte`` per byte.

    A fitted link may have a knee: bytes beyond ``knee_bytes`` cost ``beta_far_us_per_byte``
    each (on one host, once the working set leaves the caches: the 2-core VM moved 40 GB/s up
    to 8 MiB and 12-18 GB/s beyond, docs/architecture.md). ``knee_bytes`` 0: no knee. The
    extension prices the same way (``bytesUs``, csrc/algorithm/select.cc).
    """

    alpha_us: float
    beta_us_per_byte: float
    knee_bytes: float = 0.0
    beta_far_us_per_byte: float = 0.0

    def bytes_us(self, nbytes: float) -> float:
        if self.knee_bytes <= 0 or nbytes <= self.knee_bytes:
            return nbytes * self.beta_us_per_byte
        near = self.knee_bytes * self.beta_us_per_byte
        return near + (nbytes - self.knee_bytes) * self.beta_far_us_per_byte

    def us(self, steps: float, nbytes: float) -> float:
        return steps * self.alpha_us + self.bytes_us(nbytes)

    def as_list(self) -> List[float]:
        return [self.alpha_us, self.beta_us_per_byte, self.knee_bytes, self.beta_far_us_per_byte]


def terms(collective: str, algorithm: str, n: int, nbytes: float) -> Tuple[float, float]:
    """``(steps, bytes)`` of ``algorithm`` on ``n`` ranks: the coefficients of alpha and beta.

    ``nbytes``: the buffer of all_reduce / broadcast, the whole array of all_gather (output)
    and reduce_scatter (input). One rank: nothing to do.
    """
    if n <= 1:
        return 0.0, 0.0
    depth = math.ceil(math.log2(n))
    table = {
        ("all_reduce", "ring"): (2 * (n - 1), 2 * (n - 1) / n * nbytes),
        ("all_reduce", "tree"): (2 * depth, 2 * nbytes),
        ("all_reduce", "one_shot"): (1, (n - 1) * nbytes),
        ("all_gather", "ring"): (n - 1, (n - 1) / n * nbytes),
        ("all_gather", "one_shot"): (1, (n - 1) / n * nbytes),
        ("reduce_scatter", "ring"): (n - 1, (n - 1) / n * nbytes),
        ("reduce_scatter", "one_shot"): (1, (n - 1) / n * nbytes),
        ("broadcast", "tree"): (depth, nbytes),
    }
    try:
        return table[(collective, algorithm)]
    except KeyError:
        raise ValueError(f"cost model: no {algorithm!r} {collective}") from None


SHM_ALGORITHMS = {
    "all_reduce": ("ring", "tree", "one_shot"),
    "all_gather": ("ring", "one_shot"),
    "reduce_scatter": ("ring", "one_shot"),
    "broadcast": ("tree",),
}


def builtin_shm_link(oversubscribed: bool) -> Link:
    """Shared memory's built-in constants (csrc/algorithm/select.cc), through the extension."""
    from .. import _C

    alpha, beta = _C._shm_builtin_cost(oversubscribed)
    return Link(alpha, beta)


#: The shared-memory algorithms a calibration fits, in the order the extension takes them
#: (``fitted_costs`` of ``_C.CpuCommunicator``, csrc/bindings/comm.cc).
FITTED_ORDER = (
    ("all_reduce", "ring"),
    ("all_reduce", "tree"),
    ("all_reduce", "one_shot"),
    ("all_gather", "ring"),
    ("all_gather", "one_shot"),
    ("reduce_scatter", "ring"),
    ("reduce_scatter", "one_shot"),
)


@dataclass
class CostModel:
    """Fitted links; what is not fitted falls back to the built-in constants.

    ``shm[n]["all_reduce/ring"]``: the ring all-reduce on a host of n ranks (one link per
    algorithm: each is fitted on its own measurements); ``inter[engine]``: an inter-host leg.
    ``call_us[n]``: what a :class:`~dist_kernels.Communicator` call on a host of n ranks adds
    over the extension's collective (its checks and dispatch in Python; where ranks outnumber
    cores, also the time that longer call gives the scheduler), the same for every algorithm
    and size: it prices what a caller times (:meth:`call_us_of`), never a stage inside the
    extension, and so never changes what ``auto`` picks.
    """

    shm: Dict[int, Dict[str, Link]] = field(default_factory=dict)
    inter: Dict[str, Link] = field(default_factory=dict)
    meta: Dict = field(default_factory=dict)
    call_us: Dict[int, float] = field(default_factory=dict)

    def shm_link(self, n: int, collective: str, algorithm: str,
                 oversubscribed: bool = False) -> Link:  # fmt: skip
        fitted = self.shm.get(n, {}).get(f"{collective}/{algorithm}")
        return fitted or builtin_shm_link(oversubscribed)

    def fitted_costs(self, n: int) -> List[float]:
        """What the extension's ``auto`` takes: alpha, beta, knee, far beta of every algorithm
        of FITTED_ORDER for a host of n ranks (built-in where one is missing); [] if none is
        fitted for n."""
        if n not in self.shm:
            return []
        return [x for c, a in FITTED_ORDER for x in self.shm_link(n, c, a).as_list()]

    def inter_link(self, engine: str) -> Link:
        return self.inter.get(engine) or Link(**DEFAULT_INTER[engine])

    def call_us_of(self, collective: str, n: int, nbytes: float, algorithm: str) -> float:
        """A Communicator call of ``algorithm`` on one host of n ranks, as its caller times it:
        the collective plus the call's fixed cost in Python."""
        link = self.shm_link(n, collective, algorithm)
        return self.call_us.get(n, 0.0) + link.us(*terms(collective, algorithm, n, nbytes))

    def shm_us(self, collective: str, n: int, nbytes: float, algorithm: str = "best") -> float:
        """Time on the host; ``best``: the cheapest of the algorithms auto chooses from."""
        names = SHM_ALGORITHMS[collective] if algorithm == "best" else (algorithm,)
        return min(
            self.shm_link(n, collective, a).us(*terms(collective, a, n, nbytes)) for a in names
        )

    def net_us(self, collective: str, engine: str, hosts: int, per_group: float,
               groups: int = 1) -> float:  # fmt: skip
        """One inter-host stage: ``groups`` cross groups at once, ``per_group`` bytes each."""
        algorithm = "tree" if collective == "broadcast" else "ring"
        steps, nbytes = terms(collective, algorithm, hosts, per_group)
        return self.inter_link(engine).us(steps, nbytes * groups)

    def to_json(self) -> Dict:
        return {
            "shm": {
                str(n): {k: asdict(link) for k, link in sorted(links.items())}
                for n, links in sorted(self.shm.items())
            },
            "inter": {e: asdict(link) for e, link in sorted(self.inter.items())},
            "call_us": {str(n): us for n, us in sorted(self.call_us.items())},
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: Dict) -> CostModel:
        return cls(
            shm={
                int(n): {k: Link(**v) for k, v in links.items()}
                for n, links in data.get("shm", {}).items()
            },
            inter={e: Link(**v) for e, v in data.get("inter", {}).items()},
            meta=data.get("meta", {}),
            call_us={int(n): float(us) for n, us in data.get("call_us", {}).items()},
        )


def model_path() -> str:
    return os.environ.get("DK_COST_MODEL") or os.path.join(
        os.path.expanduser("~"), ".cache", "dist_kernels", "cost_model.json"
    )


def load_model(path: Optional[str] = None) -> CostModel:
    """The fitted model at ``path`` (default :func:`model_path`); none there: built-ins."""
    path = path or model_path()
    if not os.path.exists(path):
        return CostModel()
    try:
        with open(path) as f:
            return CostModel.from_json(json.load(f))
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(f"dist_kernels: ignoring the cost model {path}: {e}", stacklevel=2)
        return CostModel()


def save_model(model: CostModel, path: Optional[str] = None) -> str:
    """Writes ``model`` atomically (a temporary file renamed over the old one)."""
    path = path or model_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(model.to_json(), f, indent=1)
    os.replace(tmp, path)
    return path


# -- fitting ------------------------------------------------------------------------------------


MIN_KNEE_BYTES = 64 << 10  # below any cache a knee could stand for (L2 is larger)


def fit_link(samples: Sequence[Tuple[float, float, float]], knee: bool = True) -> Link:
    """Least squares of ``steps * alpha + bytes * beta = us`` on relative error (every size
    counts alike, 8 B as much as 64 MiB), with non-negative parameters; then the same with a
    knee (a second beta beyond it) at every eighth of an octave between the measured byte
    counts from MIN_KNEE_BYTES on, kept where it fits better by more than a tenth of the error
    (a knee must earn its two parameters). ``knee`` False: the straight line only (an
    inter-host link: no cache to leave)."""
    if not samples:
        raise ValueError("fit_link: no samples")
    best = _fit_straight(samples)
    best_error = _sq_error(best, samples)
    if best_error < 1e-12 or not knee:  # a straight line (it may fit to rounding already)
        return best
    for knee in _knee_candidates([y for _, y, _ in samples]):
        kneed = _fit_knee(samples, knee)
        if kneed is not None and _sq_error(kneed, samples) < 0.9 * best_error:
            best, best_error = kneed, _sq_error(kneed, samples)
    return best


def _knee_candidates(byte_counts: Sequence[float]) -> List[float]:
    """Powers of 2^(1/8) strictly inside the measured byte counts (a knee needs samples on
    both sides)."""
    positive = [y for y in byte_counts if y > 0]
    if len(set(positive)) < 3:
        return []
    lo, hi = max(min(positive), MIN_KNEE_BYTES), max(positive)
    first, last = math.ceil(8 * math.log2(lo)), math.floor(8 * math.log2(hi))
    return [2 ** (j / 8) for j in range(first + 1, last)]


def _weighted_lstsq(rows: List[List[float]], targets: List[float]) -> Optional[List[float]]:
    """Least squares on relative error: each row divided by its target."""
    import torch

    a = torch.tensor([[v / t for v in row] for row, t in zip(rows, targets)], dtype=torch.float64)
    b = torch.ones(len(targets), 1, dtype=torch.float64)
    if torch.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return torch.linalg.lstsq(a, b).solution.view(-1).tolist()


def _fit_straight(samples) -> Link:
    targets = [max(t, 1e-9) for _, _, t in samples]
    both = _weighted_lstsq([[x, y] for x, y, _ in samples], targets)
    if both is not None and min(both) >= 0:
        return Link(both[0], both[1])
    alpha = _weighted_lstsq([[x] for x, _, _ in samples], targets)
    beta = _weighted_lstsq([[y] for _, y, _ in samples], targets)
    one = [Link(max(alpha[0], 0.0), 0.0)] if alpha else []
    one += [Link(0.0, max(beta[0], 0.0))] if beta else []
    return min(one, key=lambda link: _sq_error(link, samples))


def _fit_knee(samples, knee: float) -> Optional[Link]:
    rows = [[x, min(y, knee), max(y - knee, 0.0)] for x, y, _ in samples]
    params = _weighted_lstsq(rows, [max(t, 1e-9) for _, _, t in samples])
    if params is None or min(params) < 0:
        return None
    return Link(params[0], params[1], knee, params[2])


def _sq_error(link: Link, samples) -> float:
    return sum((link.us(x, y) / t - 1.0) ** 2 for x, y, t in samples)


def relative_errors(link: Link, samples) -> List[float]:
    """``predicted / measured - 1`` of every sample."""
    return [link.us(x, y) / t - 1.0 for x, y, t in samples]


# -- hierarchical choices -----------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """How a hierarchical collective runs: its kind, chunk count and inter-host engine."""

    kind: str
    chunks: int
    engine: str
    predicted_us: float = 0.0


def stage_us(
    model: CostModel, collective: str, kind: str, hosts: int, local: int, s: float, engine: str
) -> Tuple[float, float]:
    """``(host stages, network stage)`` of one chunk of ``s`` bytes."""
    shm = model.shm_us
    if kind == "replicated":
        host = shm("broadcast" if collective == "broadcast" else "all_reduce", local, s)
        return host, model.net_us(collective, engine, hosts, s, local)
    host = {
        "all_reduce": lambda: shm("reduce_scatter", local, s) + shm("all_gather", local, s),
        # the local-major reorder is one more pass over the bytes
        "reduce_scatter": lambda: shm("reduce_scatter", local, s) + _copy_us(model, local, s),
        "all_gather": lambda: shm("all_gather", local, s) + _copy_us(model, local, s),
        "broadcast": lambda: shm("broadcast", local, s) + shm("all_gather", local, s),
    }[collective]()
    return host, model.net_us(collective, engine, hosts, s / local, local)


def _copy_us(model: CostModel, local: int, s: float) -> float:
    """The local-major reorder: none with one rank per host (the order is the rank order)."""
    return model.shm_link(local, "all_gather", "ring").bytes_us(s) if local > 1 else 0.0


def hierarchical_us(
    model: CostModel,
    collective: str,
    kind: str,
    hosts: int,
    local: int,
    nbytes: float,
    chunks: int,
    engine: str,
) -> float:
    """Predicted time of ``kind`` in ``chunks`` pipelined chunks (module docstring)."""
    if kind == "flat":
        n = hosts * local
        algorithm = "tree" if collective == "broadcast" else "ring"
        return model.inter_link("gloo").us(*terms(collective, algorithm, n, nbytes))
    host, net = stage_us(model, collective, kind, hosts, local, nbytes / chunks, engine)
    return host + net + (chunks - 1) * max(host, net)


def candidates(
    collective: str, nbytes: int, engines: Sequence[str], local: int = 2
) -> List[Tuple[str, int, str]]:
    """Every ``(kind, chunks, engine)`` auto weighs for ``collective`` of ``nbytes`` with
    ``local`` ranks per host."""
    kinds = (
        ["multi_leader"]
        if collective in ("reduce_scatter", "all_gather")
        else ["replicated", "multi_leader"]
    )
    # with one rank per host, flat moves what multi_leader moves (on Gloo only)
    out = [("flat", 1, "gloo")] if local > 1 else []
    chunks = [k for k in (2**i for i in range(7)) if k == 1 or nbytes / k >= MIN_CHUNK_BYTES]
    for kind in kinds:
        for engine in engines:
            out += [(kind, k, engine) for k in chunks if k <= MAX_CHUNKS]
    return out


@dataclass
class HierarchySettings:
    """What a hierarchical communicator decides by: the model and the forced choices
    (``DK_INTER_HOST``: auto | gloo | mpi, ``DK_INTER_HOST_ALGO``: auto | flat | replicated |
    multi_leader, ``DK_INTER_HOST_CHUNKS``: a chunk count, 0 = by the model).

    ``oversubscribed``: rank 0's host has more ranks than usable cores. ``auto`` then leaves
    MPI out: MPICH spins in MPI_Wait, which takes the cores the other ranks of the host need
    (measured on 2 cores, 2 emulated hosts x 2 ranks: MPICH's own all-reduce at 0.1-0.26 GB/s
    busbw against 0.5-1.1 GB/s at 2 x 1, and our MPI leg slower than our Gloo leg from 2 MiB).
    And it sends every message in one chunk: the host stages, the Gloo threads and the
    kernel's TCP work then share the cores, so overlapping them saves little, while each chunk
    adds hand-offs between ranks that wait for a core (measured, 2 emulated hosts x 2 ranks on
    one core each, load 20-38: a 16 MiB all-reduce 1.2-1.6x faster in 1 chunk than in the 4
    the model chose, 4 MiB 1.6-3x faster than in 8; 64 MiB alike within the noise).
    """

    model: CostModel = field(default_factory=CostModel)
    engine: str = "auto"
    kind: str = "auto"
    chunks: int = 0
    oversubscribed: bool = False

    def choose(
        self, collective: str, hosts: int, local: int, nbytes: int, engines: Sequence[str]
    ) -> Choice:
        """The cheapest candidate allowed by the forced settings (engines: those this rank
        has; every rank of a communicator has the same)."""
        usable = [e for e in engines if self.engine in ("auto", e)] or ["gloo"]
        if self.engine == "auto" and self.oversubscribed:
            usable = [e for e in usable if e != "mpi"] or usable
        best = None
        for kind, chunks, engine in candidates(collective, max(nbytes, 1), usable, local):
            if self.kind != "auto" and kind != self.kind:
                continue
            if kind != "flat" and (self.chunks or self.oversubscribed):
                chunks = self.chunks or 1
            us = hierarchical_us(
                self.model, collective, kind, hosts, local, max(nbytes, 1), chunks, engine
            )
            if best is None or us < best.predicted_us:
                best = Choice(kind, chunks, engine, us)
        if best is None:  # the forced kind does not exist for this collective
            return Choice("multi_leader", self.chunks or 1, usable[0])
        return best

    def to_json(self) -> Dict:
        return {
            "model": self.model.to_json(),
            "engine": self.engine,
            "kind": self.kind,
            "chunks": self.chunks,
            "oversubscribed": self.oversubscribed,
        }

    @classmethod
    def from_json(cls, data: Dict) -> HierarchySettings:
        return cls(
            CostModel.from_json(data["model"]),
            data["engine"],
            data["kind"],
            data["chunks"],
            data.get("oversubscribed", False),
        )

    @classmethod
    def from_env(cls, model: CostModel, oversubscribed: bool = False) -> HierarchySettings:
        engine = os.environ.get("DK_INTER_HOST", "auto")
        kind = os.environ.get("DK_INTER_HOST_ALGO", "auto")
        chunks = os.environ.get("DK_INTER_HOST_CHUNKS", "0")
        if engine not in ENGINE_CHOICES:
            raise ValueError(f"DK_INTER_HOST={engine!r}: one of {', '.join(ENGINE_CHOICES)}")
        if kind not in HIERARCHY_KINDS:
            raise ValueError(f"DK_INTER_HOST_ALGO={kind!r}: one of {', '.join(HIERARCHY_KINDS)}")
        if not chunks.isdigit() or int(chunks) > MAX_CHUNKS:
            raise ValueError(f"DK_INTER_HOST_CHUNKS={chunks!r}: an integer in [0, {MAX_CHUNKS}]")
        return cls(model, engine, kind, int(chunks), oversubscribed)


def shared_settings(store, rank: int, timeout, oversubscribed: bool = False) -> HierarchySettings:
    """Rank 0's settings (its environment, cost model file and ``oversubscribed``), the same
    on every rank."""
    if rank == 0:
        try:
            settings = HierarchySettings.from_env(load_model(), oversubscribed)
        except ValueError as e:  # the others must not wait for settings that never come
            store.set("hierarchy/settings", json.dumps({"error": str(e)}))
            raise
        store.set("hierarchy/settings", json.dumps(settings.to_json()))
        return settings
    store.wait(["hierarchy/settings"], timeout)
    data = json.loads(store.get("hierarchy/settings"))
    if "error" in data:
        raise ValueError(f"rank 0's settings: {data['error']}")
    return HierarchySettings.from_json(data)
