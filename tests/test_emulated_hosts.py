"""The emulated-host harness itself (tools/emulated_hosts.py): hosts share no /dev/shm and no
name, reach each other over the bridge, the link cap is set, and the namespaces are always
torn down: on exit, on an exception, on Ctrl-C, on SIGTERM, and after a SIGKILL by the next
run. No torch in these processes: they are quick."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated import ROOT, EmulatedHosts, skip_reason  # noqa: E402
from emulated import harness as eh  # noqa: E402

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
CLI = os.path.join(ROOT, "tools", "emulated_hosts.py")


def _namespaces_of(pid: int):
    return [n for n in eh._namespaces() if n.startswith(f"dk-{pid}-")]


def test_rate_and_parse_helpers():
    assert eh.parse_rate("10gbit") == 10e9 and eh.parse_rate("500mbit") == 500e6
    with pytest.raises(ValueError, match="not a link rate"):
        eh.parse_rate("10 gigs")
    assert eh.tbf_burst_bytes(1e9) == 1 << 20  # 4 ms at 1 Gbit/s is 500 KB: the 1 MiB floor
    assert eh.tbf_burst_bytes(10e9) == 5_000_000


def test_hosts_are_separate_and_reach_each_other():
    with EmulatedHosts(2, rate="1gbit") as hosts:
        names = [n for n in _namespaces_of(os.getpid())]
        assert len(names) == 3  # two hosts and the switch
        script = (
            "import os, socket; open('/dev/shm/mine', 'w').close(); "
            "print(socket.gethostname(), socket.gethostbyname('host1'), "
            "len([p for p in os.listdir('/proc') if p.isdigit()]), "
            "','.join(map(str, sorted(os.sched_getaffinity(0)))))"
        )
        outs = [hosts.run(h, [sys.executable, "-c", script]).output.split() for h in (0, 1)]
        assert outs[0][:2] == ["host0", "10.200.0.2"] and outs[1][0] == "host1"
        # a PID namespace of its own: the host sees its own few processes, not the machine's
        assert all(int(out[2]) < 10 for out in outs), outs
        # CPUs of its own where there are enough (eh.host_cpus), else the machine's
        for out, cpus in zip(outs, eh.host_cpus(2)):
            assert out[3] == (cpus or ",".join(map(str, sorted(os.sched_getaffinity(0))))), out
        assert not os.path.exists("/dev/shm/mine")  # each host's /dev/shm is its own tmpfs
        server = hosts.popen(
            1,
            [
                sys.executable,
                "-c",
                (
                    "import socket; s = socket.create_server(('0.0.0.0', 7000)); "
                    "c, _ = s.accept(); c.sendall(b'over the bridge')"
                ),
            ],
        )
        client = (
            "import socket, time\nfor _ in range(100):\n try:\n"
            "  print(socket.create_connection(('host1', 7000)).recv(64).decode()); break\n"
            " except ConnectionRefusedError: time.sleep(0.05)"
        )
        assert hosts.run(0, [sys.executable, "-c", client]).output.strip() == "over the bridge"
        hosts.wait([server], 30)
        qdisc = subprocess.run(
            ["ip", "netns", "exec", hosts.netns(0), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc, qdisc
    assert _namespaces_of(os.getpid()) == []


def test_torn_down_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedHosts(2) as hosts:
            hosts.popen(0, ["sleep", "60"])
            raise RuntimeError("inside")
    assert _namespaces_of(os.getpid()) == []


def _start_cli():
    proc = subprocess.Popen(
        [sys.executable, CLI, "--hosts", "2", "--exec", "--", "sleep", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while len(_namespaces_of(proc.pid)) < 3 or not all(
        eh._namespace_pids(n) for n in _namespaces_of(proc.pid) if n.endswith(("-h0", "-h1"))
    ):
        assert time.monotonic() < deadline, "the hosts never came up"
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_torn_down_on_a_signal(sig):
    proc = _start_cli()
    names = _namespaces_of(proc.pid)
    proc.send_signal(sig)
    proc.wait(30)
    assert _namespaces_of(proc.pid) == [], names
    assert all(not eh._namespace_pids(n) for n in names)


def test_a_sigkilled_run_is_cleaned_up_by_the_next():
    proc = _start_cli()
    sleepers = [p for n in _namespaces_of(proc.pid) for p in eh._namespace_pids(n)]
    proc.kill()
    proc.wait(30)
    assert len(_namespaces_of(proc.pid)) == 3  # nothing could run: they are still there
    removed = eh.remove_stale()
    assert sorted(removed) == sorted(n for n in removed if n.startswith(f"dk-{proc.pid}-"))
    assert _namespaces_of(proc.pid) == []
    assert not any(eh._pid_alive(p) for p in sleepers)
