"""Emulated hosts in tests: torchrun across network + mount + UTS namespaces.

The harness is ``tools/emulated_hosts.py``; this module adds what a test needs around it: the
reason to skip where namespaces are not available, and a launch that runs a script of checks
on every rank and hands their results back (``tests/multihost_checks.py``)::

    from emulated import launch_checks, skip_reason

    pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
    results = launch_checks(["collectives", "ddp"], hosts=2, nproc_per_host=2)
    results["ddp"][rank]        # the check's return value on that rank (or raises its error)

Each launch pays the torch import of every rank and agent (~3 s each on this machine): a
suite should run many checks per launch rather than one launch per check.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional, Sequence

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import emulated_hosts as harness  # noqa: E402, F401  (the module, for the harness tests)
from emulated_hosts import EmulatedHosts, missing_requirements  # noqa: E402

CHECKS_SCRIPT = os.path.join(TESTS_DIR, "multihost_checks.py")


@functools.cache
def skip_reason() -> Optional[str]:
    """Why emulated hosts cannot run here (not root, no iproute2, namespaces refused), or
    None. Tries one namespace for real: a container may be root and still be refused."""
    reason = missing_requirements()
    if reason:
        return reason
    probe = f"dk-{os.getpid()}-probe-sw"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"emulated hosts: `ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class CheckFailed(AssertionError):
    """A check raised on a rank; the message holds that rank's traceback."""


class RankResults(dict):
    """``{rank: value}`` of one check; reading a rank whose check raised raises its error."""

    def __init__(self, name: str, values: Dict[int, object], errors: Dict[int, str]) -> None:
        super().__init__(values)
        self.name, self.errors = name, errors

    def ok(self) -> RankResults:
        if self.errors:
            raise CheckFailed(
                "\n".join(f"check {self.name!r} rank {r}:\n{e}" for r, e in self.errors.items())
            )
        return self


def launch_checks(
    checks: Sequence[str],
    hosts: int = 2,
    nproc_per_host: int = 2,
    timeout: float = 600.0,
    env: Optional[Dict[str, str]] = None,
    rate: Optional[str] = None,
    during: Optional[Callable[[EmulatedHosts, str], None]] = None,
) -> Dict[str, RankResults]:
    """Runs ``checks`` (functions of multihost_checks.py) on every rank, in one torchrun
    launch across ``hosts`` emulated hosts; returns each check's per-rank results.

    ``during(cluster, out_dir)``, if given, runs while the ranks do (a test that kills a
    host); once it returns, the hosts are torn down without waiting for the ranks to exit.
    """
    with tempfile.TemporaryDirectory(prefix="dk-multihost-") as out:
        full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        with EmulatedHosts(hosts, rate=rate) as cluster:
            procs = cluster.torchrun([CHECKS_SCRIPT, out, *checks], nproc_per_host, env=full_env)
            if during is None:
                cluster.wait(procs, timeout)
            else:
                during(cluster, out)
        log = "\n".join(f"--- host{p.host} (exit {p.proc.returncode}):\n{p.output}" for p in procs)
        print(log[-20000:])
        return {name: _collect(out, name, hosts * nproc_per_host, log) for name in checks}


def _collect(out: str, name: str, world_size: int, log: str) -> RankResults:
    values, errors = {}, {}
    for rank in range(world_size):
        path = os.path.join(out, f"{name}.{rank}")
        if os.path.exists(path + ".pkl"):
            with open(path + ".pkl", "rb") as f:
                values[rank] = pickle.load(f)
        elif os.path.exists(path + ".err"):
            with open(path + ".err") as f:
                errors[rank] = f.read()
        else:
            errors[rank] = (
                f"no result (the rank died or never got there); launch log:\n{log[-4000:]}"
            )
    return RankResults(name, values, errors)


def run_torchrun(
    argv: Sequence[str],
    hosts: int = 2,
    nproc_per_host: int = 2,
    timeout: float = 600.0,
    env: Optional[Dict[str, str]] = None,
) -> List[str]:
    """``torchrun --nnodes hosts`` of ``argv`` across emulated hosts; returns each host's
    output, raising if any host's torchrun failed."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    with EmulatedHosts(hosts) as cluster:
        procs = cluster.torchrun(argv, nproc_per_host, env=full_env)
        cluster.wait(procs, timeout)
    failed = [p for p in procs if p.proc.returncode != 0]
    if failed:
        raise AssertionError(
            "\n".join(f"--- host{p.host} exited {p.proc.returncode}:\n{p.output}" for p in procs)
        )
    return [p.output for p in procs]
