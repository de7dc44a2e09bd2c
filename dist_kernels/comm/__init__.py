"""The communicator layer: :class:`Communicator`, :class:`Work` and the module-level calls.

``base`` holds what the CPU and CUDA communicators share (``BaseCommunicator``) and
``algorithms`` the one table of algorithm names; ``communicator`` chooses a backend per group
and checks arguments; the backends below it carry the calls to ``_C``: ``shm`` (one host, POSIX
shared memory), ``hierarchical`` (shared memory inside a host, gloo between host leaders),
``cuda`` (the CUDA communicator over ``_C.NcclCommunicator``, NCCL loaded at run time by
``nccl``). ``work`` holds the handle type that every backend returns.
"""

from .base import BaseCommunicator
from .communicator import (
    Communicator,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_default_communicator,
    init,
    irecv,
    isend,
    recv,
    reduce_scatter,
    send,
)
from .work import Work

__all__ = [
    "BaseCommunicator",
    "Communicator",
    "Work",
    "init",
    "get_default_communicator",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
]
