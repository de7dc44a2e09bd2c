"""Which rank sits on which host, and the inter-host groups of the multi-leader design (pure).

A communicator's ranks are grouped by host (``hosts[r]``: the host id of rank r); hosts are
numbered in order of first appearance and a host's ranks in rank order (its *local* ranks).
When every host has the same number R of ranks, local rank l of every host joins the
inter-host group ``cross[l]``, whose member h is host h's local rank l::

    4 ranks on 2 hosts (torchrun: host-major)      cross[0] = [0, 2]   (host 0's and 1's
       host 0: ranks 0 1                           cross[1] = [1, 3]    local rank 0 / 1)
       host 1: ranks 2 3

The R groups carry R disjoint slices of an inter-host leg at the same time (MVAPICH2's
multi-leader design: every local rank drives the network, not one leader per host). With
unequal hosts only ``cross[0]`` (the host leaders) exists.

Block orders: a reduce-scatter across hosts first reduce-scatters on the host, then across
hosts; for every rank to end with its own chunk, the host-level reduce-scatter must give local
rank l the chunks of the ranks it will exchange with, ``cross[l]``, in member order. That is
the *local-major* order below (for host-major ranks, a transpose of the host x local grid).
The all-gather runs the same steps backwards.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import List, Sequence, Tuple


def host_id() -> str:
    """This process's host: ``DK_HOST_ID`` (tests fake hosts with it), else the hostname."""
    return os.environ.get("DK_HOST_ID") or socket.gethostname()


@dataclass(frozen=True)
class HostLayout:
    """The host grouping of one communicator, seen from rank ``rank``."""

    hosts: Tuple[str, ...]
    rank: int

    @classmethod
    def of(cls, hosts: Sequence[str], rank: int) -> HostLayout:
        if not 0 <= rank < len(hosts):
            raise ValueError(f"HostLayout: rank {rank} is not in [0, {len(hosts)})")
        return cls(tuple(hosts), rank)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def host_order(self) -> List[str]:
        """Host ids in order of first appearance: host index h is ``host_order[h]``."""
        return list(dict.fromkeys(self.hosts))

    @property
    def num_hosts(self) -> int:
        return len(self.host_order)

    def host_index(self, rank: int) -> int:
        return self.host_order.index(self.hosts[rank])

    def ranks_on(self, host: int) -> List[int]:
        """The ranks of host index ``host``, in rank order (its local ranks)."""
        name = self.host_order[host]
        return [r for r in range(self.world_size) if self.hosts[r] == name]

    def local_rank_of(self, rank: int) -> int:
        return self.ranks_on(self.host_index(rank)).index(rank)

    @property
    def my_host(self) -> int:
        return self.host_index(self.rank)

    @property
    def local_ranks(self) -> List[int]:
        return self.ranks_on(self.my_host)

    @property
    def local_rank(self) -> int:
        return self.local_rank_of(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks (the multi-leader design needs it)."""
        return len({len(self.ranks_on(h)) for h in range(self.num_hosts)}) == 1

    def rank_at(self, host: int, local: int) -> int:
        return self.ranks_on(host)[local]

    def cross_group(self, local: int) -> List[int]:
        """Ranks of ``cross[local]``: local rank ``local`` of every host, in host order."""
        return [self.rank_at(h, local) for h in range(self.num_hosts)]

    @property
    def cross_groups(self) -> List[List[int]]:
        """Every inter-host group: one per local rank (uniform hosts), else the leaders'."""
        count = self.local_size if self.uniform else 1
        return [self.cross_group(lr) for lr in range(count)]

    @property
    def my_cross(self) -> int:
        """Index of this rank's inter-host group in :attr:`cross_groups`, or -1 (none)."""
        for index, group in enumerate(self.cross_groups):
            if self.rank in group:
                return index
        return -1

    def local_major_order(self) -> List[int]:
        """Ranks ordered local rank first, then host: ``[rank_at(h, l) for l for h]``.

        Block b of a reduce-scatter input laid out in this order lands, after the host-level
        reduce-scatter (blocks of H) and the reduce-scatter across ``cross[l]``, on rank
        ``local_major_order()[b]``.
        """
        r = self.local_size
        return [self.rank_at(h, lr) for lr in range(r) for h in range(self.num_hosts)]


def split_even(count: int, parts: int, granule: int = 1) -> List[Tuple[int, int]]:
    """``parts`` consecutive ``(offset, length)`` ranges covering ``count``, each a multiple of
    ``granule`` (the last takes the rest); empty ranges are dropped."""
    if parts < 1 or granule < 1:
        raise ValueError(f"split_even: parts ({parts}) and granule ({granule}) must be >= 1")
    units = count // granule
    base, extra = divmod(units, parts)
    ranges, offset = [], 0
    for p in range(parts):
        length = (base + (p < extra)) * granule
        if p == parts - 1:
            length = count - offset
        if length:
            ranges.append((offset, length))
        offset += length
    return ranges
