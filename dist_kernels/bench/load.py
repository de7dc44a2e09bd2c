"""A competing load beside the benchmark: ``--load N`` busy processes at ``--load-nice``.

Users run collectives beside data-loader workers and other jobs, so a latency measured on an
idle machine is not the one they meet. Each busy process spins in pure Python (one runnable
thread, no memory traffic to speak of) at the niceness asked for: 0 competes for a core as an
equal, 19 only takes what nobody else wants (the scheduler still gives it a small share).

The processes are the benchmark's children and are always stopped when it ends (the context
manager terminates, then kills). Should the benchmark itself be killed with SIGKILL, each
process notices that its parent changed and exits within a fraction of a second, so nothing
is left spinning on the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

# The busy loop: checks every ~1e5 iterations (a few ms) whether the benchmark is still alive.
_SPIN = """
import os, sys
parent, nice = int(sys.argv[1]), int(sys.argv[2])
os.nice(nice)
while os.getppid() == parent:
    for _ in range(100000):
        pass
"""
STOP_SECONDS = 5.0


class BusyLoad:
    """``count`` busy processes at niceness ``nice`` while the ``with`` block runs."""

    def __init__(self, count: int, nice: int = 0) -> None:
        if count < 0:
            raise ValueError(f"--load {count}: the number of busy processes must be >= 0")
        if not 0 <= nice <= 19:
            raise ValueError(f"--load-nice {nice}: a niceness from 0 to 19")
        self.count, self.nice = count, nice
        self.procs: List[subprocess.Popen] = []

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> BusyLoad:
        parent = str(os.getpid())
        try:
            for _ in range(self.count):
                command = [sys.executable, "-c", _SPIN, parent, str(self.nice)]
                self.procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminates every process, kills those still there after STOP_SECONDS, reaps all."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []

    def info(self) -> Dict[str, Any]:
        """What the benchmark's meta data records (the pids let a test check they are gone)."""
        return {"processes": self.count, "nice": self.nice, "pids": self.pids}


def describe(info: Optional[Dict[str, Any]]) -> str:
    """The header's words for :meth:`BusyLoad.info`."""
    if not info or not info["processes"]:
        return "none"
    return f"{info['processes']} busy process(es) at nice {info['nice']} (--load)"
