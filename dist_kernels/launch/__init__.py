"""Local ranks for tests, benchmarks and the command-line tools: spawned processes with a
torch.distributed group among them, meeting through a store their launcher holds open.

    from dist_kernels import launch

    results = launch.run(2, fn, 1000, 7)      # fn(1000, 7) once on 2 fresh ranks (gloo group)
    with launch.LocalRanks(4) as ranks:       # or keep the ranks and send them calls
        outcomes = ranks.run(fn, (1000, 7))

``python -m dist_kernels.bench``, ``python -m dist_kernels.train``, ``benchmarks/*.py`` and the
test pools (``tests/mp_pool.py``) all start their local ranks here (docs/architecture.md).
"""

from .ranks import EnvValue, LocalRanks, RankDied, RankError, RanksError, run
from .rendezvous import LocalStore, RankAddress

__all__ = [
    "EnvValue",
    "LocalRanks",
    "LocalStore",
    "RankAddress",
    "RankDied",
    "RankError",
    "RanksError",
    "run",
]
