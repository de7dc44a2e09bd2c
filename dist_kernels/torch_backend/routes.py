"""Which communicator serves each device of a "dk" process group.

torch hands a Python process group every device (its creator's group replaces torch's
per-device table), so ``init_process_group("cpu:dk,cuda:nccl")`` is routed here: devices
mapped to "dk" run on our communicators (CPU: shared memory, made with the group; CUDA: our
CUDA communicator, made at the first CUDA call, when a device is known), devices mapped to
"gloo" or "nccl" on a torch backend this group holds and hands the whole call to.

torch tells a creator neither the device it is called for nor the other devices' backends.
It records the group's backend string once the creator has returned, readable through
``torch.distributed.get_backend_config(group)``: the group reads it at its first call
(:func:`device_backends`, :meth:`Routes.resolve`). The CPU communicator cannot wait for that:
its rendezvous needs every rank of the group, which only the group's creation guarantees (a
first call may be a send between two of them), so it is made with the group and closed again
if the group turns out to send CPU tensors elsewhere.
"""

from __future__ import annotations

import datetime
import sys
import threading
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from . import BACKEND_NAME, DEVICES
from .dynamo import skip_module

TORCH_BACKENDS = ("gloo", "nccl")


def device_backends(group: dist.ProcessGroup) -> Dict[str, str]:
    """device type -> backend name, from the backend string torch recorded for ``group``
    (``"cpu:dk,cuda:nccl"``); "dk" for every device where torch has none (a group made
    outside ``init_process_group`` / ``new_group``)."""
    try:
        config = dist.get_backend_config(group)
    except Exception:  # noqa: BLE001 - torch raises different errors for an unknown group
        config = ""
    pairs = [pair.split(":", 1) for pair in config.split(",") if ":" in pair]
    return {device: backend for device, backend in pairs} or dict.fromkeys(DEVICES, BACKEND_NAME)


class Routes:
    """The communicator (ours) or torch backend (delegated) of each device type.

    Args:
        store: the group's store (this object takes sub-prefixes of it per device).
        rank, world_size, timeout: as torch handed them to the creator.
        label: "[rank r] dk group 'name'", for errors.

    Made with our CPU communicator; :meth:`resolve` then sets the device table.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        label: str,
    ) -> None:
        from ..comm.communicator import Communicator

        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.label = timeout, label
        #: device type -> "dk", "gloo" or "nccl"; None until :meth:`resolve`.
        self.backends: Optional[Dict[str, str]] = None
        # Whether any device goes to a torch backend (else calls skip the device lookup).
        self.delegates = False
        self._torch: Dict[str, Any] = {}
        self._lock = threading.Lock()
        self._ours: Dict[str, Any] = {
            "cpu": Communicator(
                store=dist.PrefixStore("cpu/", store),
                rank=rank,
                world_size=world_size,
                timeout=self.comm_timeout(),
            )
        }

    def resolve(self, backends: Dict[str, str]) -> None:
        """Sets the device table once (:func:`device_backends`); raises ValueError for a
        backend a dk group cannot hand a device to."""
        for device, backend in backends.items():
            if backend != BACKEND_NAME and backend not in TORCH_BACKENDS:
                raise ValueError(
                    f"{self.label}: device {device!r} asks for backend {backend!r}; a dk group "
                    f"can hand a device to {' or '.join(TORCH_BACKENDS)} only"
                )
        with self._lock:
            if self.backends is not None:
                return
            unused = self._ours.pop("cpu", None) if backends.get("cpu") != BACKEND_NAME else None
            if unused is not None:
                unused.close()
            if backends.get("cpu") == "gloo":  # collective: every rank's first call makes it
                self._torch["cpu"] = self._torch_backend("cpu", "gloo")
            self.delegates = any(b in TORCH_BACKENDS for b in backends.values())
            self.backends = dict(backends)

    def delegate(self, device: Optional[torch.device]) -> Optional[Any]:
        """The torch backend that serves ``device``, or None when we do."""
        kind = device.type if device is not None else self.default_device()
        if self.backends.get(kind) not in TORCH_BACKENDS:
            return None
        with self._lock:
            if kind not in self._torch:
                self._torch[kind] = self._torch_backend(kind, self.backends[kind])
            return self._torch[kind]

    def held(self, kind: str) -> Optional[Any]:
        """The torch backend already made for device type ``kind``, else None; never makes
        one (making a gloo backend is collective, and torch asks from one rank)."""
        with self._lock:
            return self._torch.get(kind)

    def comm(self, device: Optional[torch.device], what: str) -> Any:
        """Our communicator for ``device`` (CPU, or CUDA made on first use)."""
        kind = device.type if device is not None else self.default_device()
        if self.backends.get(kind) != BACKEND_NAME:
            raise ValueError(
                f"{self.label}: {what}: tensors on {kind}, but this group serves "
                f"{', '.join(f'{d}:{b}' for d, b in self.backends.items())}"
            )
        with self._lock:
            if kind not in self._ours:
                self._ours[kind] = self._cuda_comm(device)
            return self._ours[kind]

    def comm_timeout(self) -> datetime.timedelta:
        """Our communicators' timeout: torch's group timeout when it was set, else DK_TIMEOUT or
        5 minutes (comm/timeout.py); the torch backends this group hands devices to keep
        torch's."""
        from ..comm.timeout import resolve_timeout

        return resolve_timeout(None, self.timeout)

    def ours_on_cpu(self) -> Optional[Any]:
        """Our CPU communicator, or None when CPU tensors go elsewhere."""
        return self._ours.get("cpu")

    def default_device(self) -> str:
        """The device of calls without tensors (barrier): CPU when this group serves it."""
        return "cpu" if "cpu" in self.backends else next(iter(self.backends))

    def _cuda_comm(self, device: Optional[torch.device]) -> Any:
        from ..comm.communicator import Communicator

        index = device.index if device is not None and device.index is not None else None
        return Communicator(
            device=torch.device("cuda", index) if index is not None else "cuda",
            timeout=self.comm_timeout(),
            store=dist.PrefixStore("cuda/", self.store),
            rank=self.rank,
            world_size=self.world_size,
        )

    def _torch_backend(self, device: str, backend: str) -> Any:
        store = dist.PrefixStore(f"{device}-{backend}/", self.store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        if not dist.is_nccl_available():
            raise RuntimeError(f"{self.label}: {device}:nccl asked for, but torch has no NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        return dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """For the communicators made so far, the torch backends held, and those made later."""
        with self._lock:
            self.timeout = timeout
            for comm in self._ours.values():
                if hasattr(comm, "set_timeout"):
                    comm.set_timeout(timeout)
                else:  # the CUDA communicator reads its timeout at every host wait
                    comm.timeout = timeout
            for backend in self._torch.values():
                backend._set_default_timeout(timeout)

    def close(self) -> None:
        for comm in self._ours.values():
            comm.close()
        self._ours.clear()
        for backend in self._torch.values():
            shutdown = getattr(backend, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self._torch.clear()


skip_module(sys.modules[__name__])  # torch.compile must not trace these frames (dynamo.py)
