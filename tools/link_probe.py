"""The link's own ceiling: bytes per second that N parallel TCP streams push between two hosts.

It is what iperf3 -P N measures, in the standard library: the server accepts ``streams``
connections and counts what arrives; the client sends a 1 MiB buffer on each for ``seconds``
and then reports. Run the server on one emulated host and the client on another::

    python tools/link_probe.py server --port 5201 --streams 4        # on host1
    python tools/link_probe.py client 10.200.0.2 --port 5201 --streams 4 --seconds 3

The client prints ``ceiling_bytes_per_s=<float>`` (what the server received over the time from
the first to the last byte), which benchmarks/bench_multihost.py reads.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from typing import List

CHUNK = 1 << 20


def serve(port: int, streams: int, timeout: float = 120.0) -> float:
    """Accepts ``streams`` connections, receives until all close; returns bytes per second."""
    listener = socket.create_server(("0.0.0.0", port), backlog=streams, reuse_port=False)
    listener.settimeout(timeout)
    conns = [listener.accept()[0] for _ in range(streams)]
    listener.close()
    counts: List[int] = [0] * streams
    first_last = [float("inf"), 0.0]
    lock = threading.Lock()

    def receive(i: int) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = conns[i].recv_into(view)
            if n == 0:
                break
            now = time.perf_counter()
            with lock:
                first_last[0] = min(first_last[0], now)
                first_last[1] = max(first_last[1], now)
            counts[i] += n

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(counts)
    for c in conns:
        c.sendall(f"{total} {first_last[1] - first_last[0]:.9f}\n".encode())
        c.close()
    return total / max(first_last[1] - first_last[0], 1e-9)


def probe(host: str, port: int, streams: int, seconds: float) -> float:
    """Sends on ``streams`` connections for ``seconds``; returns the server's bytes per second."""
    conns = []
    deadline = time.monotonic() + 60.0
    while len(conns) < streams:
        try:
            conns.append(socket.create_connection((host, port), timeout=60.0))
        except ConnectionRefusedError:  # the server is not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(CHUNK)
    stop = time.monotonic() + seconds

    def send(c: socket.socket) -> None:
        while time.monotonic() < stop:
            c.sendall(payload)
        c.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=send, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reply = conns[0].makefile().readline().split()
    for c in conns:
        c.close()
    total, elapsed = int(reply[0]), float(reply[1])
    return total / max(elapsed, 1e-9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/link_probe.py", description=__doc__)
    parser.add_argument("role", choices=("server", "client"))
    parser.add_argument("host", nargs="?", help="the server's address (client)")
    parser.add_argument("--port", type=int, default=5201)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.role == "server":
        serve(args.port, args.streams)
        return 0
    if not args.host:
        parser.error("client needs the server's address")
    rate = probe(args.host, args.port, args.streams, args.seconds)
    print(f"ceiling_bytes_per_s={rate:.6g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
