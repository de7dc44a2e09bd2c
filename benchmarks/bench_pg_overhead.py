"""What the "dk" ProcessGroup costs per call over the direct Communicator call.

    python benchmarks/bench_pg_overhead.py [--nproc 1 2 4] [--calls 5000] [--blocks 7]

On fresh local ranks (``dist_kernels.launch``, one torch thread each), per call of a small
collective (8 B all_reduce; at more than one rank also a 4-float ``all_gather_into_tensor``):

- ``direct``: the Communicator under the group (``group.communicator()``), called directly;
- ``dk``: ``torch.distributed.all_reduce(t, group=g)`` on a ``new_group(backend="dk")``;
- ``floor``: the same torch call on a group of a Python backend that does nothing and returns
  a finished Work: what torch's own dispatch costs any Python backend (issue 28's floor);
- ``C++ floor``: the same torch call on torch's own ``FakeProcessGroup`` (a C++ backend that
  does nothing, ``torch.testing._internal.distributed.fake_pg``): what the dispatch costs a
  backend written in C++, the route a compiled ``"dk"`` backend would take.

Each block times ``--calls`` calls of one kind; the kinds alternate, block after block, so that
machine noise hits them alike; a row prints the median and the best block, in us per call, on
the slowest rank. ``dk - direct`` is this layer's overhead, ``dk - direct - floor`` what it
costs beyond torch's dispatch. At one rank no peer is waited for: the figures are CPU time
alone, the steadiest measure on a loaded machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dist_kernels import launch  # noqa: E402

NOOP = "dk_bench_noop"


class _NoopWork(dist.Work):
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _NoopGroup(dist.ProcessGroup):
    """A Python backend whose collectives do nothing: torch's dispatch cost alone."""

    def allreduce(self, tensors, opts=None):
        return _NoopWork()

    def all_gather_single(self, output, input, opts=None):
        return _NoopWork()

    def getBackendName(self) -> str:
        return NOOP


def _register_noop() -> None:
    if NOOP not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            NOOP,
            lambda opts, *_: _NoopGroup(opts.group_rank, opts.group_size),
            extended_api=True,
            devices=["cpu"],
        )


def _cases(world: int) -> Dict[str, Dict[str, Callable[[], None]]]:
    """op -> kind -> one call."""
    import dist_kernels.torch_backend  # noqa: F401  (registers "dk")

    _register_noop()
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    dk_group = dist.new_group(backend="dk")
    noop_group = dist.new_group(backend=NOOP)
    fake_group = dist.new_group(backend="fake")
    comm = dk_group.communicator()
    t = torch.zeros(2)
    cases = {
        "all_reduce 8 B": {
            "direct": lambda: comm.all_reduce(t),
            "dk": lambda: dist.all_reduce(t, group=dk_group),
            "floor": lambda: dist.all_reduce(t, group=noop_group),
            "C++ floor": lambda: dist.all_reduce(t, group=fake_group),
        }
    }
    if world > 1:
        out, inp = torch.zeros(4 * world), torch.zeros(4)
        cases["all_gather_into_tensor 16 B"] = {
            "direct": lambda: comm.all_gather(out, inp),
            "dk": lambda: dist.all_gather_into_tensor(out, inp, group=dk_group),
            "floor": lambda: dist.all_gather_into_tensor(out, inp, group=noop_group),
            "C++ floor": lambda: dist.all_gather_into_tensor(out, inp, group=fake_group),
        }
    return cases, comm


def _rank_main(calls: int, blocks: int) -> Dict[str, Dict[str, List[float]]]:
    world = dist.get_world_size()
    cases, comm = _cases(world)
    times: Dict[str, Dict[str, List[float]]] = {}
    for op, kinds in cases.items():
        for fn in kinds.values():  # warm-up: first-call routing, caches
            for _ in range(100):
                fn()
        per_kind = times.setdefault(op, {k: [] for k in kinds})
        for _ in range(blocks):
            for kind, fn in kinds.items():
                comm.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                per_kind[kind].append((time.perf_counter() - start) / calls * 1e6)
    return times


def _slowest(outcomes: List[Dict], op: str, kind: str) -> List[float]:
    """Per block, the slowest rank's time."""
    return [max(block) for block in zip(*(o[op][kind] for o in outcomes))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--calls", type=int, default=5000, help="calls per timed block")
    p.add_argument("--blocks", type=int, default=7, help="timed blocks per kind")
    args = p.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  command: "
        f"python {' '.join(sys.argv)}"
    )
    print(
        f"# load average at start {[round(x, 2) for x in os.getloadavg()]} "
        f"({os.cpu_count()} cpus); torch {torch.__version__}"
    )
    print(
        f"# {'ranks':>5} {'op':<30} {'direct':>14} {'dk':>14} {'floor':>14} {'C++ floor':>14} "
        f"{'dk-direct':>10} {'-floor':>8}   (us per call: median [best] block)"
    )
    for world in args.nproc:
        outcomes = launch.run(world, _rank_main, args.calls, args.blocks, timeout=900)
        for op in outcomes[0]:
            med, best = {}, {}
            cells = []
            for kind in ("direct", "dk", "floor", "C++ floor"):
                blocks = _slowest(outcomes, op, kind)
                med[kind], best[kind] = statistics.median(blocks), min(blocks)
                cells.append(f"{med[kind]:7.2f} [{best[kind]:5.2f}]")
            over = med["dk"] - med["direct"]
            print(
                f"  {world:>5} {op:<30} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} "
                f"{cells[3]:>14} {over:>+10.2f} {over - med['floor']:>+8.2f}"
            )
    print(f"# load average at end {[round(x, 2) for x in os.getloadavg()]}")


if __name__ == "__main__":
    main()
