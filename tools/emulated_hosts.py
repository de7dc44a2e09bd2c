"""Emulated hosts on one Linux machine: a real host boundary for tests and benchmarks.

Each host is a network namespace with its own ``eth0``, hostname (a UTS namespace), private
``/dev/shm`` (a mount namespace with a fresh tmpfs), SysV IPC (an IPC namespace) and process
ids (a PID namespace, with its own /proc), so ranks on different hosts share no memory, no
loopback, no name and cannot see each other's processes: they meet only through TCP over the
emulated network. (Without the IPC and PID namespaces MPICH's UCX transport found the other
host's ranks through SysV shared memory and process_vm_readv and bypassed the link: 1.05 GB/s
all-reduce through a 1 Gbit/s cap.) The
hosts hang off one bridge in a "switch" namespace; a token bucket (``tc tbf``) on each host's
``eth0`` can cap its uplink (this kernel has no netem, so no delay or loss emulation)::

      host0 (10.200.0.1)   host1 (10.200.0.2)  ...
        eth0 [tbf]           eth0 [tbf]
          |                    |
          +---- br0 (switch namespace) ----+

Needs root, ``ip`` (iproute2), ``tc`` and ``unshare`` (util-linux). Every name carries this
process's pid and a random tag, so two runs on one machine cannot collide, and a run that was
SIGKILLed leaves namespaces the next run removes (their owner pid is gone). Teardown kills
every process inside the namespaces and deletes them, on a normal exit, on an exception, on
Ctrl-C and on SIGTERM.

    python tools/emulated_hosts.py --hosts 2 --nproc-per-host 2 --rate 1gbit -- \\
        -m dist_kernels.train --dp 2 --tp 2          # torchrun --nnodes 2 on the two hosts
    python tools/emulated_hosts.py --hosts 2 --exec -- hostname    # any command on each host

As a library (tests/emulated.py, benchmarks/bench_multihost.py)::

    with EmulatedHosts(2, rate="10gbit") as hosts:
        procs = hosts.torchrun(["script.py"], nproc_per_host=2)
        outputs = hosts.wait(procs, timeout=300)
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

SUBNET = "10.200.0"
MASTER_PORT = 29500
_NAME = re.compile(r"^dk-(\d+)-([0-9a-f]+)-(\w+)$")

# Run inside the host's namespaces (sh -c, pid 1 of the host's PID namespace after unshare's
# fork): a private tmpfs on /dev/shm, this run's hosts file
# over /etc/hosts (so the host names resolve to the emulated addresses, as DNS would on a
# cluster, and gloo picks eth0 rather than loopback), the hostname, then the command.
_ENTER = (
    'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && mount --bind "$1" /etc/hosts && '
    'hostname "$2" && shift 2 && exec "$@"'
)


def missing_requirements() -> Optional[str]:
    """Why emulated hosts cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return f"emulated hosts need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "emulated hosts need root (network, mount, UTS, IPC and PID namespaces)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` on PATH"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _namespaces() -> List[str]:
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _kill_namespace(netns: str, grace: float) -> None:
    """SIGTERM every process in ``netns``, SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = _namespace_pids(netns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in _namespace_pids(netns) if _pid_alive(p)]
        if not pids:
            return


def _namespace_pids(netns: str) -> List[int]:
    out = _run("ip", "netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def remove_stale() -> List[str]:
    """Deletes the namespaces of runs whose process is gone (a SIGKILLed run); returns them."""
    removed = []
    for netns in _namespaces():
        match = _NAME.match(netns)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace(netns, grace=0.5)
            _run("ip", "netns", "del", netns, check=False)
            removed.append(netns)
    return removed


def tbf_burst_bytes(rate_bits: float) -> int:
    """The token bucket's burst: at least 1 MiB, and 4 ms of the rate (above one timer tick at
    HZ=250, or the bucket empties between ticks and the link never reaches its rate)."""
    return max(1 << 20, int(rate_bits / 8 * 0.004))


def parse_rate(text: str) -> float:
    """``'10gbit'``, ``'1gbit'``, ``'500mbit'`` -> bits per second (tc's decimal units)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if not match:
        raise ValueError(f"not a link rate: {text!r} (e.g. 1gbit, 10gbit, 500mbit)")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


class HostProcess:
    """A process started on one emulated host. Its output (stdout and stderr together) is read
    as it comes, so a chatty process never blocks on a full pipe; ``output`` holds all of it
    once :meth:`EmulatedHosts.wait` has returned. ``echo``: also print each line, prefixed
    with the host."""

    def __init__(self, host: int, proc: subprocess.Popen, echo: bool = False) -> None:
        self.host, self.proc, self.echo = host, proc, echo
        self._lines: List[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)
            if self.echo:
                print(f"[host{self.host}] {line}", end="", flush=True)

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def join(self, timeout: Optional[float]) -> bool:
        """Waits for the output to end (the process closed it); True if it did."""
        self._reader.join(timeout)
        return not self._reader.is_alive()


def host_cpus(hosts: int) -> List[Optional[str]]:
    """Each host's share of this process's CPUs (``taskset -c`` lists), disjoint and equal;
    None for every host where there are fewer CPUs than hosts, or no taskset: they share."""
    cpus = sorted(os.sched_getaffinity(0))
    per_host = len(cpus) // hosts
    if per_host == 0 or shutil.which("taskset") is None:
        return [None] * hosts
    return [",".join(map(str, cpus[h * per_host : (h + 1) * per_host])) for h in range(hosts)]


class EmulatedHosts:
    """``hosts`` emulated hosts joined by a switch; ``rate`` caps each host's uplink.

    Args:
        hosts: number of hosts (each gets ``host<i>`` at ``10.200.0.<i+1>``).
        rate: tc rate such as ``"1gbit"``; None leaves the link uncapped.
        mtu: the interfaces' MTU.
        split_cpus: give each host its own CPUs (:func:`host_cpus`), as real hosts have: a
            host then sees how many cores its ranks really have (a host of 2 ranks on 1 core
            is oversubscribed, which the communicator adapts to).
    """

    def __init__(
        self, hosts: int = 2, rate: Optional[str] = None, mtu: int = 1500, split_cpus: bool = True
    ) -> None:
        if hosts < 1:
            raise ValueError(f"EmulatedHosts: hosts must be >= 1, got {hosts}")
        reason = missing_requirements()
        if reason:
            raise RuntimeError(reason)
        self.hosts = hosts
        self.mtu = mtu
        self.cpus = host_cpus(hosts) if split_cpus else [None] * hosts
        self.rate: Optional[str] = None
        self.tag = f"dk-{os.getpid()}-{secrets.token_hex(3)}"
        self._created: List[str] = []
        self._procs: List[HostProcess] = []
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self._hosts_file = os.path.join(self._dir, "hosts")
        self._old_sigterm = None
        self._closed = False
        try:
            remove_stale()
            self._build()
            self.set_rate(rate)
        except BaseException:
            self.close()
            raise

    # -- names -------------------------------------------------------------------------------

    def netns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @staticmethod
    def host_name(host: int) -> str:
        return f"host{host}"

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    # -- building and tearing down ------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        with open(self._hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for h in range(self.hosts):
                f.write(f"{self.address(h)} {self.host_name(h)}\n")
        self._add_netns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h in range(self.hosts):
            ns = self.netns(h)
            self._add_netns(ns)
            port = f"p{h}"
            # Both ends are created inside their namespaces: no name in the root namespace.
            _run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
                "mtu",
                str(self.mtu),
            )
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def set_rate(self, rate: Optional[str]) -> None:
        """Caps every host's uplink at ``rate`` (tc tbf on its eth0); None removes the cap."""
        for h in range(self.hosts):
            tc = ("ip", "netns", "exec", self.netns(h), "tc", "qdisc")
            if rate is None:
                _run(*tc, "del", "dev", "eth0", "root", check=False)
                continue
            burst = tbf_burst_bytes(parse_rate(rate))
            # latency bounds the queue (packets beyond it are dropped): 20 ms keeps TCP's
            # window from collapsing on drops at 1 Gbit/s.
            _run(
                *tc,
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                "20ms",
            )
        self.rate = rate

    def close(self) -> None:
        """Kills every process on the hosts and deletes the namespaces (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for name in reversed(self._created):
            _kill_namespace(name, grace=2.0)
        for hp in self._procs:
            if hp.proc.poll() is None:
                hp.proc.kill()
            hp.proc.wait()
        for name in reversed(self._created):
            _run("ip", "netns", "del", name, check=False)
        self._created = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmulatedHosts:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a CI timeout, `kill`) tears down like Ctrl-C does, through __exit__.
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    # -- running -----------------------------------------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> List[str]:
        """The argv that runs ``argv`` inside host ``host``'s namespaces."""
        return [
            "ip",
            "netns",
            "exec",
            self.netns(host),
            "unshare",
            "--mount",
            "--uts",
            "--ipc",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "--",
            *(["taskset", "-c", self.cpus[host]] if self.cpus[host] else []),
            "sh",
            "-c",
            _ENTER,
            "sh",
            self._hosts_file,
            self.host_name(host),
            *argv,
        ]

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        env: Optional[Dict[str, str]] = None,
        echo: bool = False,
        **kwargs,
    ) -> HostProcess:
        """Starts ``argv`` on host ``host`` (stdout and stderr merged into a pipe by default;
        ``echo`` prints its lines as they come)."""
        if self._closed:
            raise RuntimeError("EmulatedHosts: closed")
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen(
            self.command(host, argv), env=env, text=True, start_new_session=True, **kwargs
        )
        hp = HostProcess(host, proc, echo)
        self._procs.append(hp)
        return hp

    def run(
        self,
        host: int,
        argv: Sequence[str],
        timeout: float = 60.0,
        env: Optional[Dict[str, str]] = None,
    ) -> HostProcess:
        """Runs ``argv`` on ``host`` to the end; raises if it fails."""
        hp = self.popen(host, argv, env=env)
        self.wait([hp], timeout)
        if hp.proc.returncode != 0:
            raise RuntimeError(
                f"host{host}: {list(argv)} exited {hp.proc.returncode}:\n{hp.output}"
            )
        return hp

    def torchrun_argv(
        self,
        host: int,
        argv: Sequence[str],
        nproc_per_host: int,
        max_restarts: int = 0,
        port: int = MASTER_PORT,
    ) -> List[str]:
        """``torchrun --nnodes H`` for ``host``; host0 holds the rendezvous store.

        Without restarts the rendezvous is static (``--node-rank``: ranks are host-major, as
        on a cluster); with ``max_restarts`` it is c10d's, which lets a restarted host rejoin.
        """
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.hosts}",
            f"--nproc-per-node={nproc_per_host}",
        ]
        if max_restarts:
            launch += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.address(0)}:{port}",
                f"--rdzv-id={self.tag}",
                f"--max-restarts={max_restarts}",
                "--rdzv-conf=join_timeout=300,last_call_timeout=1",
            ]
        else:
            launch += [
                f"--node-rank={host}",
                f"--master-addr={self.address(0)}",
                f"--master-port={port}",
            ]
        return launch + list(argv)

    def torchrun(
        self,
        argv: Sequence[str],
        nproc_per_host: int,
        env: Optional[Dict[str, str]] = None,
        max_restarts: int = 0,
        hosts: Optional[Sequence[int]] = None,
        echo: bool = False,
    ) -> List[HostProcess]:
        """Starts torchrun on every host (or on ``hosts``); ``argv``: the script and its args."""
        env = dict(os.environ if env is None else env)
        env.setdefault("OMP_NUM_THREADS", "1")
        if max_restarts:
            # torch's c10d rendezvous shares the agent's store with the workers and publishes
            # its address only in the first round: an agent started anew (a host that came
            # back) then waits for it in the next round forever. Unshared, every round
            # publishes it.
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return [
            self.popen(h, self.torchrun_argv(h, argv, nproc_per_host, max_restarts), env, echo)
            for h in (range(self.hosts) if hosts is None else hosts)
        ]

    def wait(self, procs: Sequence[HostProcess], timeout: float) -> List[HostProcess]:
        """Waits for ``procs`` to end; on timeout kills them and raises with their output."""
        deadline = time.monotonic() + timeout
        for hp in procs:
            if not hp.join(max(0.0, deadline - time.monotonic())):
                for other in procs:
                    _kill_group(other.proc)
                for other in procs:
                    other.join(5.0)
                tails = "\n".join(f"--- host{p.host}:\n{p.output[-3000:]}" for p in procs)
                raise TimeoutError(f"emulated hosts: still running after {timeout:.0f} s\n{tails}")
            hp.proc.wait()
        return list(procs)

    def kill_host(self, host: int) -> None:
        """SIGKILLs every process on ``host`` at once: the host is gone, as in a power cut."""
        for pid in _namespace_pids(self.netns(host)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


# -- command line ------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/emulated_hosts.py",
        description="Run torchrun (or any command) on emulated hosts: network, mount and UTS "
        "namespaces joined by a bridge; needs root.",
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-host", type=int, default=1)
    parser.add_argument("--rate", help="cap each host's uplink (tc tbf), e.g. 1gbit, 10gbit")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--exec", action="store_true", help="run the command itself, no torchrun")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py args")
    args = parser.parse_args(argv)
    # Ctrl-C tears the hosts down even when this process was started with SIGINT ignored (a
    # background job of a shell without job control, nohup): Python keeps an inherited ignore.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    reason = missing_requirements()
    if reason:
        print(f"emulated_hosts: {reason}", file=sys.stderr)
        return 2
    with EmulatedHosts(args.hosts, rate=args.rate) as hosts:
        if args.exec:
            procs = [hosts.popen(h, command, echo=True) for h in range(args.hosts)]
        else:
            procs = hosts.torchrun(
                command, args.nproc_per_host, max_restarts=args.max_restarts, echo=True
            )
        hosts.wait(procs, args.timeout)
        return max(hp.proc.returncode for hp in procs)


if __name__ == "__main__":
    sys.exit(main())
