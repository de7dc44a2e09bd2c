"""The cost model at scale: all-reduce time and busbw of ring, tree and hierarchical, to 1,024
ranks (8 per host), for given links (``python -m dist_kernels.bench --project``).

Links: one inside a host, one between hosts, each with a per-step alpha, a per-byte beta
(1 / bus bandwidth of one rank) and, as NCCL models it, a fixed per-collective base latency.
With n ranks on H hosts of R::

    ring         base + 2(n-H) a_in + 2(H-1) a_out + 2(n-1)/n S max(b_in, b_out)
                 (one ring through every rank; 2(H-1) of its steps cross hosts, and the
                 slowest link paces every step)
    tree         base + 2((R-1) a_in + log2(H) a_out) + 2 S max(b_in, b_out)
                 (NCCL's double binary tree: a chain inside each host, a tree of hosts)
    hierarchical base + 2(R-1) a_in + 2(H-1) a_out + 2(R-1)/R S b_in + 2(H-1)/H S/R b_out
                 (ours: reduce-scatter in the host, R rings of hosts at once each on its own
                 link with 1/R of the data, all-gather in the host)

The latency terms are NCCL's own tuning model (src/graph/tuning.cc: ring latency counts
``nsteps - nInterSteps`` intra-host and ``nInterSteps`` network steps; tree latency is
``2 ((nRanks/nNodes - 1) intraLat + log2i(nNodes) interLat)``). ``NCCL_H100`` holds NCCL's
published figures for 8 x H100 per host on NVLink with one 400 Gbit/s NIC per GPU: the
hardware latencies of that table (Simple protocol) and the ~365 GB/s ring busbw nccl-tests
report for 8 GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence


@dataclass(frozen=True)
class Links:
    """Per-step latency (us) and per-byte time (us / B) inside a host and between hosts."""

    alpha_in_us: float
    beta_in_us_per_byte: float
    alpha_out_us: float
    beta_out_us_per_byte: float
    base_us: float = 0.0


#: NCCL's figures: base latency 8.4 us and per-step hardware latencies 3.4 us (NVLink) and
#: 9.6 us (network), ring / Simple (tuning.cc); 365 GB/s ring busbw on 8 x H100 (nccl-tests,
#: NVLink 4); 50 GB/s per GPU between hosts (one 400 Gbit/s NIC each).
NCCL_H100 = Links(3.4, 1 / 365e3, 9.6, 1 / 50e3, base_us=8.4)
RANKS_PER_HOST = 8
WORLD_SIZES = tuple(8 * 2**k for k in range(8))  # 8 ... 1024
SIZES = (8, 1 << 20, 256 << 20)


def ring_us(links: Links, n: int, per_host: int, nbytes: float) -> float:
    hosts = max(1, n // per_host)
    inter_steps = 2 * (hosts - 1)
    steps = 2 * (n - 1)
    beta = max(links.beta_in_us_per_byte, links.beta_out_us_per_byte if hosts > 1 else 0.0)
    return (
        links.base_us
        + (steps - inter_steps) * links.alpha_in_us
        + inter_steps * links.alpha_out_us
        + 2 * (n - 1) / n * nbytes * beta
    )


def tree_us(links: Links, n: int, per_host: int, nbytes: float) -> float:
    hosts = max(1, n // per_host)
    local = min(n, per_host)
    beta = max(links.beta_in_us_per_byte, links.beta_out_us_per_byte if hosts > 1 else 0.0)
    latency = 2 * (
        (local - 1) * links.alpha_in_us + math.floor(math.log2(hosts)) * links.alpha_out_us
    )
    return links.base_us + latency + 2 * nbytes * beta


def hierarchical_us(links: Links, n: int, per_host: int, nbytes: float) -> float:
    hosts = max(1, n // per_host)
    local = min(n, per_host)
    return (
        links.base_us
        + 2 * (local - 1) * links.alpha_in_us
        + 2 * (hosts - 1) * links.alpha_out_us
        + 2 * (local - 1) / local * nbytes * links.beta_in_us_per_byte
        + 2 * (hosts - 1) / hosts * nbytes / local * links.beta_out_us_per_byte
    )


ALGORITHMS = {"ring": ring_us, "tree": tree_us, "hierarchical": hierarchical_us}


def busbw_gbs(n: int, nbytes: float, us: float) -> float:
    """nccl-tests' all-reduce busbw: algbw x 2(n-1)/n, in GB/s."""
    return nbytes / us / 1e3 * 2 * (n - 1) / n


def table(
    links: Links,
    per_host: int = RANKS_PER_HOST,
    world_sizes: Sequence[int] = WORLD_SIZES,
    sizes: Sequence[int] = SIZES,
) -> List[Dict]:
    """One row per (ranks, size): each algorithm's time (us) and busbw (GB/s)."""
    rows = []
    for n in world_sizes:
        for s in sizes:
            row = {"ranks": n, "hosts": max(1, n // per_host), "bytes": s}
            for name, fn in ALGORITHMS.items():
                us = fn(links, n, per_host, s)
                row[name] = {"us": us, "busbw": busbw_gbs(n, s, us)}
            rows.append(row)
    return rows


def format_table(rows: List[Dict], title: str) -> List[str]:
    lines = [
        f"# {title}",
        "#   ranks  hosts       size |"
        + "".join(f" {name:>12s} us {'busbw':>7s} |" for name in ALGORITHMS),
    ]
    for r in rows:
        cells = "".join(f" {r[name]['us']:15.1f} {r[name]['busbw']:7.1f} |" for name in ALGORITHMS)
        lines.append(f"#  {r['ranks']:6d} {r['hosts']:6d} {r['bytes']:10d} |{cells}")
    return lines
