"""Where spawned local ranks meet: a TCPStore their launcher hosts, under a prefix of their own.

The store's port comes from the kernel (the server binds port 0) and stays bound as long as the
:class:`LocalStore` lives: nothing finds a free port, closes it and hopes to bind it again, so
no other process can take the port between the launcher choosing it and the ranks joining.
Every group of ranks works under a prefix holding 64 random bits: a process of another run that
reaches this port anyway (through a port race of its own) reads and writes keys that no rank of
ours touches, so the ranks of two runs cannot meet.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Optional

HOST = "127.0.0.1"


@dataclass(frozen=True)
class RankAddress:
    """What a spawned rank needs to join its group (picklable: it travels to the rank)."""

    port: int
    """The launcher's store."""
    prefix: str
    """This group's keys in that store."""
    world_size: int
    """Ranks in the group."""
    timeout_s: float
    """The store's and the process group's timeout."""

    def init_process_group(self, rank: int, backend: str = "gloo") -> None:
        """``torch.distributed.init_process_group`` as ``rank`` of this group."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        client = dist.TCPStore(HOST, self.port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(self.prefix, client)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=self.world_size, timeout=timeout
        )


class LocalStore:
    """A TCPStore server in this process for the ranks it spawns; :meth:`close` frees the port."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._server: Optional[Any] = dist.TCPStore(
            HOST, 0, None, is_master=True, wait_for_workers=False
        )
        self._run = secrets.token_hex(8)
        self._groups = itertools.count()

    def address(self, world_size: int, timeout_s: float) -> RankAddress:
        """A new group of ``world_size`` ranks on this store."""
        if self._server is None:
            raise RuntimeError("LocalStore: closed")
        prefix = f"dk-launch/{self._run}/{next(self._groups)}/"
        return RankAddress(self._server.port, prefix, world_size, timeout_s)

    def close(self) -> None:
        self._server = None  # the server stops, and its port is freed, with the last reference
