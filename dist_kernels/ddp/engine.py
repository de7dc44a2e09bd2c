"""DistributedDataParallel: bucketed gradient all-reduce overlapped with backward.

Drop-in for ``torch.nn.parallel.DistributedDataParallel`` where the options mean the same::

    model = dk.DDP(module, bucket_cap_mb=25, grad_dtype=torch.bfloat16)
    loss = model(x).sum(); loss.backward()        # .grad now holds the mean over ranks
    with model.no_sync(): model(x2).sum().backward()   # accumulate locally

How one backward runs (details in docs/ddp.md):

0. A synchronised backward's pass starts where it reaches the forward's outputs (a hook on
   them), so its end-of-backward callback belongs to the outermost backward even under
   reentrant checkpointing, whose nested backward passes may run the first parameter hooks.
1. A post-accumulate-grad hook marks each parameter ready, at its last firing (a hook fires
   once per nested backward its gradient flows through; a static graph's first backward
   counts them, see ``_set_static_graph``). When a bucket's last gradient is ready (and every
   earlier bucket has been launched, so all ranks issue collectives in the same order), its
   gradients are brought into the bucket multiplied by 1 / world_size (cast to a
   low-precision wire dtype, or, when ``.grad`` already is a view of the bucket, scaled in
   place; one fused pass that also flags inf/NaN) and its all-reduce starts asynchronously,
   overlapping the rest of backward. With a comm hook (``register_comm_hook``), the bucket
   goes to the hook instead, undivided (``ddp/hooks.py``, ``ddp/grad_bucket.py``).
2. A callback queued on the autograd engine runs when backward ends: it launches what is left
   (parameters without gradients under ``find_unused_parameters``), waits, and points ``.grad``
   at its bucket view (same dtype on the wire) or unpacks into it (cast back, one pass).
3. After the first synchronised backward the buckets are re-planned in the order gradients
   actually became ready on rank 0, broadcast so that all ranks agree.

The last bucket carries three status elements summed by its own all-reduce: "found inf" (for
loss scaling, so skipping a step costs no extra collective), "incomplete backward" (a rank had a
parameter without a gradient) and "aborted" (a rank's backward raised midway; it sends its
remaining buckets at its next forward): every rank raises instead of one hanging.

Uneven inputs: under :meth:`DistributedDataParallel.join` a rank out of batches shadows the
others' collectives (``ddp/join.py``).

Whether a backward synchronises is decided before it starts: by its forward (with
``require_backward_grad_sync`` True, i.e. not inside ``no_sync()``), or by
:meth:`DistributedDataParallel.set_requires_gradient_sync`, whichever ran last; while that
switch is off, forwards do not arm at all.

On one rank nothing is bucketed or sent: a synchronised backward only checks that every
parameter got a gradient, unscales for the loss scaler and flags inf/NaN, in place.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils._pytree import tree_leaves

from .. import comm as communicator
from ..amp.bucketing import pack, plan_buckets, unpack, unscale_
from ..dtypes import DTYPE_CODES, ReduceOp
from . import plan
from .grad_bucket import GradBucket, Reductions
from .join import DDPJoinHook

__all__ = ["DistributedDataParallel", "DDP"]

_WIRE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)
_MB = 1024 * 1024


def _resolve_comm(module: nn.Module, comm: Any, process_group: Any) -> Tuple[Any, bool]:
    """(communicator, created here) from ``comm`` or torch's ``process_group`` argument."""
    if comm is not None and process_group is not None:
        raise ValueError(
            "DistributedDataParallel: pass comm or process_group, not both (comm is a "
            "dist_kernels Communicator, process_group a torch ProcessGroup)"
        )
    if process_group is None:
        return (comm, False) if comm is not None else _default_comm(module)
    try:
        default = communicator.get_default_communicator()
    except RuntimeError:
        default = None
    if default is not None and default.group is process_group:
        return default, False
    return communicator.Communicator(group=process_group, device=_module_device(module)), True


def _module_device(module: nn.Module) -> str:
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return "cuda" if device.type == "cuda" else "cpu"


def _default_comm(module: nn.Module) -> Tuple[Any, bool]:
    """(communicator, created here): the default one if ``dk.init()`` ran, else a new one."""
    try:
        return communicator.get_default_communicator(), False
    except RuntimeError:
        return communicator.Communicator(device=_module_device(module)), True


class _BackwardPass:
    """Bookkeeping of one synchronised backward."""

    def __init__(
        self, layouts: Sequence[plan.BucketLayout], num_params: int, device: torch.device
    ) -> None:
        self.pending = [len(b.param_indices) for b in layouts]
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.ready_order: List[int] = []
        #: How often each parameter's gradient hook fired: more than once when reentrant
        #: checkpointing sends its gradient through several (nested) backward passes.
        self.firings = [0] * num_params
        #: First iteration of a static graph: hooks only count (``firing_order`` records each
        #: firing); everything is reduced at the end, and the counts are kept for later passes.
        self.counting = False
        self.firing_order: List[int] = []
        self.next_launch = 0
        self.works: List[Any] = [None] * len(layouts)  # Work, or (Future, buffer) with a hook
        self.status = plan.STATUS_OK  # the worst status a bucket was launched with
        self.shadow = False  # a joined rank's stand-in for the others' backward (zeros)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.pre_scale = 1.0
        #: Weak reference to the end-of-backward callback queued on autograd: it dies unrun
        #: when autograd abandons the backward (an exception midway).
        self.end: Optional[weakref.ref] = None

    def abandoned(self) -> bool:
        """True once autograd has dropped this pass's end-of-backward callback unrun."""
        return self.end is None or self.end() is None


class _EndOfBackward:
    """The callback queued on the autograd engine at the start of a synchronised backward."""

    def __init__(self, finish) -> None:
        self._finish = finish

    def __call__(self) -> None:
        self._finish()


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism over a dist_kernels Communicator, with torch DDP's options.

    Which backward passes synchronise: a backward all-reduces when it is *armed* as it starts.
    Three things set the arming, the last one to run wins:

    * a forward with gradients enabled arms when :attr:`require_backward_grad_sync` is True
      (torch's attribute: False inside :meth:`no_sync`, and scripts may set it) and the
      gradient sync switch is on, and disarms otherwise (a forward under ``torch.no_grad()``
      changes nothing);
    * :meth:`set_requires_gradient_sync` sets the switch and arms or disarms at once, so it
      also decides for a backward whose forward already ran (inside ``no_sync()`` or not);
    * the end of a synchronised backward disarms (one reduction per forward, as in torch DDP):
      a second backward through the same graph accumulates locally unless re-armed.

    On one rank (``comm.world_size == 1``) nothing is bucketed or sent and ``.grad`` stays where
    autograd put it; a synchronised backward still raises on parameters without a gradient
    (unless ``find_unused_parameters``), unscales for ``loss_scaler`` and sets
    :attr:`found_inf`, in one in-place pass. ``grad_dtype`` then has no effect, and
    :attr:`buckets` and :attr:`bucket_layouts` are empty.

    Args:
        module: the model; identical structure on every rank (checked at construction). At
            least one parameter must require a gradient (else ``ValueError``: there is nothing
            to average; torch DDP refuses such a module too).
        comm: a :class:`dist_kernels.Communicator`; default: the one ``dk.init()`` made, else
            a new one over the default group (closed by :meth:`close`).
        bucket_cap_mb: bucket size cap in MiB (torch: 25).
        first_bucket_mb: cap of the first bucket, so communication starts early in backward.
        grad_dtype: dtype on the wire (``torch.bfloat16``/``torch.float16``), reduced with FP32
            accumulation; None keeps each parameter's dtype.
        algorithm: all-reduce algorithm passed to the Communicator ("auto", "ring", "tree").
        gradient_predivide_factor: divide gradients by this before the all-reduce and by
            ``world_size / factor`` after (None: divide by ``world_size`` before, as torch does).
        find_unused_parameters: parameters that get no gradient in a backward are treated as
            ready with a zero gradient; ones unused on every rank keep ``.grad`` untouched.
        broadcast_buffers: broadcast buffers from rank 0 before every forward.
        loss_scaler: a :class:`dist_kernels.LossScaler` (built without ``comm``): gradients are
            unscaled during the end of backward and the scaler learns whether any rank had an
            inf/NaN from the last bucket's all-reduce; call ``scaler.step`` and ``update`` as
            usual but not ``scaler.unscale_`` (the gradients already are; the hand-off is
            :meth:`dist_kernels.LossScaler.mark_unscaled`). One synchronised backward per
            ``scaler.update()``.
        process_group: torch's argument: a torch ProcessGroup to average over (the default
            Communicator if it is that group's, else a new one over it, closed by
            :meth:`close`). Not together with ``comm``.
        device_ids, output_device: torch's; checked only (None for CPU modules, a CUDA
            module's own device): the module is not moved.
        dim: torch's scatter dimension; must be 0 (nothing is scattered).
        gradient_as_bucket_view: ``.grad`` of contiguous parameters become views of the
            buckets, so nothing is copied out after the all-reduce (torch's meaning). Our
            default is True (torch's is False): the views save a copy per step and differ only
            in that ``.grad`` tensors alias the buckets. Has no effect with a low-precision
            wire or a ``gradient_predivide_factor`` (the result is cast or scaled on the way
            out).
        init_sync: torch's: broadcast rank 0's parameters and buffers at construction (the
            structure is compared across ranks either way).
        static_graph: torch's: the graph is the same every iteration. The first synchronised
            backward counts how often each parameter's gradient hook fires (more than once under
            reentrant checkpointing) and reduces everything at its end; later ones mark a
            parameter ready at its counted firing, and those that got no gradient in the first
            are unused every iteration, without ``find_unused_parameters`` (see
            :meth:`_set_static_graph`).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Any = None,
        *,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        grad_dtype: Optional[torch.dtype] = None,
        algorithm: str = "auto",
        gradient_predivide_factor: Optional[float] = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        loss_scaler: Any = None,
        process_group: Any = None,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        dim: int = 0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        _check_options(
            module, bucket_cap_mb, first_bucket_mb, grad_dtype, gradient_predivide_factor
        )
        _check_devices(module, device_ids, output_device, dim)
        self.module = module
        self.device_ids = None if device_ids is None else list(device_ids)
        self.output_device = output_device
        self.dim = dim
        self.comm, self._owns_comm = _resolve_comm(module, comm, process_group)
        self._device = torch.device(getattr(self.comm, "device", "cpu"))
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        self._local = self.world_size == 1  # nothing to reduce: gradients stay in place
        self.grad_dtype = grad_dtype
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        #: torch's attribute: True when constructed so or after :meth:`_set_static_graph`.
        self.static_graph = False
        #: Static graph: per parameter, how often its hook fired in the first synchronised
        #: backward (0: unused); None until that backward completed on every rank.
        self._static_firings: Optional[List[int]] = None
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_bytes_cap = int(bucket_cap_mb * _MB)
        self.broadcast_buffers = broadcast_buffers
        self.loss_scaler = loss_scaler
        self._bucket_cap_bytes = int(bucket_cap_mb * _MB)
        self._first_bucket_bytes = int(first_bucket_mb * _MB)
        # Gradients are multiplied by 1 / factor on their way into the bucket (fused with the
        # copy or cast, so FP16 partial sums stay in range), summed, and by factor / world_size
        # on the way out. When that is 1 and the wire dtype is the parameters' own (FP32 or
        # BF16), contiguous parameters' .grad become views of the registered buckets and nothing
        # is copied out; the inverse loss scale then joins the pre-scale too.
        self._predivide = gradient_predivide_factor
        factor = float(gradient_predivide_factor or self.world_size)
        self._pre_scale, self._post_scale = 1.0 / factor, factor / self.world_size
        self._grad_views = (
            gradient_as_bucket_view
            and not self._local
            and self._post_scale == 1.0
            and all(
                grad_dtype in (None, p.dtype) and p.dtype != torch.float16
                for p in module.parameters()
                if p.requires_grad
            )
        )
        self._debug = os.environ.get("DK_DEBUG", "0") not in ("", "0")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._module_buffers = [b for _, b in module.named_buffers()]
        self._check_models_agree()
        self._check_trainable()
        if init_sync:
            self._broadcast_state(list(module.parameters()) + self._module_buffers)
        self._buffer_flat = self._alloc_bytes(self._module_buffers)

        #: Whether forwards arm their backward to synchronise (torch DDP's attribute): False inside
        #: :meth:`no_sync`, and scripts may set it themselves (nanoGPT sets it per micro-step).
        self.require_backward_grad_sync = True
        self._armed = False  # whether the next backward synchronises
        self._sync_switch = True  # set_requires_gradient_sync; persistent, like FSDP2's
        self._unused_at_forward: List[int] = []
        self._pass: Optional[_BackwardPass] = None
        self._sequence = 0
        self._divide_by_initial_world_size = True  # set by join()
        self._join_work: Any = None  # the Join all-reduce counting the active ranks
        self._reductions = None if self._local else Reductions(self.comm, algorithm)
        self._comm_hook: Any = None
        self._comm_hook_state: Any = None
        self._hook_status: Optional[torch.Tensor] = None  # status slots when a hook runs
        self._rebuilt = self._local
        #: Whether the last synchronised backward had an inf/NaN gradient on any rank.
        self.found_inf = False
        if self._local:
            self._used_mask = None
            self._set_no_buckets()
        else:
            self._used_mask = self.comm.empty((max(1, len(self._params)),), torch.float32)
            self._set_layouts(list(reversed(range(len(self._params)))))
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]
        with torch.enable_grad():  # the parameters' AccumulateGrad nodes (autograd keeps one)
            self._grad_accumulators = [
                p.view_as(p).grad_fn.next_functions[0][0] for p in self._params
            ]
        if static_graph:
            self._set_static_graph()

    # ----------------------------------------------------------------- construction

    def _check_models_agree(self) -> None:
        """Raises ValueError on every rank when parameter/buffer names or shapes differ."""
        if self.world_size == 1:
            return
        named = list(self.module.named_parameters())
        entries = [  # requires_grad decides the bucket plan: it must agree too
            entry + ("" if p.requires_grad else " frozen")
            for entry, (_, p) in zip(plan.describe_parameters(named), named)
        ]
        entries += [
            "buffer " + e for e in plan.describe_parameters(list(self.module.named_buffers()))
        ]
        per_rank = self._all_gather_bytes("\n".join(entries).encode())
        message = plan.first_description_mismatch([b.decode().split("\n") for b in per_rank])
        if message:
            raise ValueError(f"[rank {self.rank}] {message}")

    def _check_trainable(self) -> None:
        """ValueError when no parameter requires a gradient: there is nothing to average.

        Runs after :meth:`_check_models_agree`, so every rank has the same structure and raises
        alike (a local check first would leave the other ranks waiting in that collective).
        """
        if self._params:
            return
        frozen = len(list(self.module.parameters()))
        buffers = len(self._module_buffers)
        if frozen:
            what = f"none of the module's {frozen} parameters requires a gradient"
        elif buffers:
            what = f"the module has {buffers} buffer(s) but no parameters"
        else:
            what = "the module has no parameters and no buffers"
        raise ValueError(
            f"[rank {self.rank}] DistributedDataParallel: {what}, so there are no gradients to "
            "average (torch DDP refuses such a module too). Do not wrap it"
            + (", or unfreeze the parameters to train first" if frozen else "")
            + (
                "; to keep buffers equal on every rank, broadcast them from rank 0"
                if buffers
                else ""
            )
            + "."
        )

    def _all_gather_bytes(self, data: bytes) -> List[bytes]:
        dev = self._device
        lengths = torch.zeros(self.world_size, dtype=torch.int64, device=dev)
        self.comm.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=dev))
        longest = int(lengths.max())
        if longest == 0:
            return [b""] * self.world_size
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(dev)
        out = torch.zeros(self.world_size * longest, dtype=torch.uint8, device=dev)
        self.comm.all_gather(out, mine)
        chunks = out.view(self.world_size, longest).cpu()
        return [bytes(chunks[r, : int(lengths[r])].tolist()) for r in range(self.world_size)]

    def _alloc_bytes(self, tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.world_size == 1 or total == 0:
            return None
        return self.comm.empty((total,), torch.uint8)

    def _broadcast_state(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copies rank 0's values of ``tensors`` to every rank: one byte-wise broadcast."""
        flat = self._alloc_bytes(tensors)
        if flat is not None:
            _broadcast_bytes(self.comm, flat, tensors)

    def _set_layouts(self, order: Sequence[int]) -> None:
        """Plans buckets in ``order`` and allocates them in registered memory (collective)."""
        layouts = self._plan(order)
        self._layouts = layouts
        self._layout_id = plan.layout_signature(layouts)
        self._bucket_of = {i: b.index for b in layouts for i in b.param_indices}
        self._buckets = [self.comm.empty((b.numel,), b.dtype) for b in layouts]
        for bucket in self._buckets:
            bucket.zero_()
        self._views: List[Optional[torch.Tensor]] = [None] * len(self._params)
        for b, bucket in zip(layouts, self._buckets):
            for index, offset, size in zip(b.param_indices, b.offsets, b.sizes):
                param = self._params[index]
                if self._grad_views and param.is_contiguous():
                    self._views[index] = bucket[offset : offset + size].view(param.shape)
        self._attach_views(self._params_with_grad())

    def _set_no_buckets(self) -> None:
        """One rank: no plan, no buckets, no views (``.grad`` stays where autograd puts it)."""
        #: The bucket plan (printable), in launch order; None on one rank.
        self.bucket_plan = None
        self._layouts: List[plan.BucketLayout] = []
        self._layout_id = 0
        self._bucket_of = {}
        self._buckets: List[torch.Tensor] = []
        self._views = [None] * len(self._params)

    def _plan(self, order: Sequence[int]) -> List[plan.BucketLayout]:
        #: The bucket plan (printable), in launch order; None on one rank.
        self.bucket_plan = plan_buckets(
            list(zip(self._names, self._params)),
            cap_bytes=self._bucket_cap_bytes,
            dtype=self.grad_dtype,
            first_bucket_bytes=self._first_bucket_bytes,
            order=list(order),
        )
        return plan.layouts_from_plan(self.bucket_plan.buckets)

    def _params_with_grad(self) -> List[int]:
        return [i for i, p in enumerate(self._params) if p.grad is not None]

    def _attach_views(self, indices: Sequence[int]) -> None:
        """Points .grad of these parameters at their bucket views (copying current values)."""
        with torch.no_grad():
            for index in indices:
                view, param = self._views[index], self._params[index]
                if view is None or _is_view(param.grad, view):
                    continue
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view

    def close(self) -> None:
        """Removes the gradient hooks; closes the Communicator if this engine created it.

        ``.grad`` tensors that are bucket views are copied out first, so they stay valid.
        """
        self._abandon_if_stale()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for param, view in zip(self._params, self._views):
            if view is not None and _is_view(param.grad, view):
                param.grad = view.clone()
        if self._owns_comm and hasattr(self.comm, "close"):
            self.comm.close()

    def _abandon_if_stale(self) -> None:
        if self._pass is not None and self._pass.abandoned():
            self._abandon_pass()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduces every bucket with ``hook(state, bucket)`` instead of the built-in all-reduce.

        Torch's contract (``torch.nn.parallel.DistributedDataParallel.register_comm_hook``):
        ``bucket`` is a :class:`dist_kernels.ddp.hooks.GradBucket` holding this rank's summed
        gradients (not divided by the world size); the hook returns a
        ``torch.futures.Future`` whose value is the reduced buffer (a tensor of the buffer's
        size, or a one-element list of it), copied back into the bucket and from there into
        ``.grad``. Shipped hooks are in :mod:`dist_kernels.ddp.hooks` (``dk.ddp_hooks``);
        torch's own hooks (over ``torch.distributed``) work too. Register once, before the
        first backward.

        With a hook, ``grad_dtype`` and ``gradient_predivide_factor`` must be None (the hook
        decides the wire format and the division), and the found-inf and error status travel
        in a separate 3-element all-reduce. On one rank nothing is reduced and the hook is
        not called.
        """
        self._abandon_if_stale()
        if self._comm_hook is not None:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel.register_comm_hook: a hook "
                f"({_hook_name(self._comm_hook)}) is already registered; register once"
            )
        if not callable(hook):
            raise TypeError(
                f"[rank {self.rank}] DistributedDataParallel.register_comm_hook: hook must be "
                f"callable as hook(state, bucket), got {type(hook).__name__}"
            )
        if self._pass is not None:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel.register_comm_hook: called during "
                "a synchronised backward; register before the first backward"
            )
        if self.grad_dtype is not None or self._predivide is not None:
            raise ValueError(
                f"[rank {self.rank}] DistributedDataParallel.register_comm_hook: the hook "
                "decides the wire dtype and the division; construct without grad_dtype "
                f"(got {self.grad_dtype}) and gradient_predivide_factor"
            )
        self._comm_hook, self._comm_hook_state = hook, state
        self._pre_scale = 1.0  # the hook divides (torch's hooks get undivided gradients)
        if not self._local:
            self._hook_status = self.comm.empty((plan.STATUS_SLOTS,), torch.float32)

    @property
    def bytes_all_reduced(self) -> int:
        """Payload bytes this rank has handed to all-reduces in backward passes (read-only).

        Buckets (or what a comm hook sends instead), status slots and used masks; not the
        construction-time broadcasts. A ring all-reduce moves ``2 (n - 1) / n`` times this per
        rank. The difference over one step is that step's cost on the wire.
        """
        return 0 if self._reductions is None else self._reductions.bytes

    @property
    def reductions_launched(self) -> int:
        """Bucket all-reduces launched since construction (read-only).

        A synchronised backward launches ``len(bucket_layouts)`` of them (the small used-mask
        all-reduce of ``find_unused_parameters`` is not counted); a backward that does not
        synchronise launches none. Always 0 on one rank, where nothing is reduced.
        """
        return self._sequence

    @property
    def buckets(self) -> List[torch.Tensor]:
        """The registered bucket tensors, in launch order (the last carries the status slots)."""
        return list(self._buckets)

    @property
    def bucket_layouts(self) -> List[plan.BucketLayout]:
        """The current bucket plan, in launch order."""
        return list(self._layouts)

    def describe_buckets(self) -> str:
        """The bucket plan, one bucket a line, with parameter names."""
        lines = []
        for b in self._layouts:
            names = ", ".join(self._names[i] for i in b.param_indices)
            lines.append(f"{b.describe()}: {names}")
        return "\n".join(lines)

    # ----------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module. With gradients enabled it also decides whether the next backward
        synchronises: yes, unless inside :meth:`no_sync` or with the gradient sync switch off
        (a forward under ``torch.no_grad()`` leaves the decision as it was)."""
        self._abandon_if_stale()
        join_work = Join.notify_join_context(self)  # None unless under join()
        deciding = torch.is_grad_enabled()
        if deciding:
            self._armed = self.require_backward_grad_sync and self._sync_switch
        self._sync_buffers(active=True)
        if self._join_config.enable:
            # Tell joined ranks whether a synchronised backward follows (they shadow it).
            self._join_flag(deciding and self._armed)
            self._join_work = None if self._divide_by_initial_world_size else join_work
        output = self.module(*args, **kwargs)
        if deciding:
            self._hook_outputs(output)
            # Only an overlap optimisation (see _start_pass): the end of backward finds any
            # parameter still without a gradient, so a later set_requires_gradient_sync(True)
            # after a no_sync() forward stays correct with the empty list.
            self._unused_at_forward = self._unused_for(output)
        return output

    def _unused_for(self, output: Any) -> List[int]:
        """Parameters to mark ready (unused) when the armed backward starts."""
        if not self._armed or self._local or not self._allow_unused:
            return []
        if not self.static_graph:
            return self._unused_in_graph(output)
        # A static graph's unused parameters are those without a gradient in its first
        # backward (until then, none: they are found at its end). Not the graph walk, which
        # misses parameters inside reentrant checkpoints (recomputed during backward).
        return [i for i, n in enumerate(self._static_firings or []) if n == 0]

    def _hook_outputs(self, output: Any) -> None:
        """Makes an armed backward start its pass where it reaches the outputs.

        The end-of-backward callback is queued on the backward that starts the pass. Started
        by the first parameter's hook, that can be a nested backward of reentrant
        checkpointing (a checkpointed last layer), which ends before the outer one, so before
        the other parameters' gradients (torch DDP queues its callback from the outputs too,
        in ``_DDPSink``). Leaves are skipped: a hook there would outlive this forward.
        """
        for tensor in tree_leaves(output):
            if torch.is_tensor(tensor) and tensor.grad_fn is not None:
                tensor.register_hook(self._output_reached)

    def _output_reached(self, grad: torch.Tensor) -> None:
        self._abandon_if_stale()
        if self._pass is None and self._armed and self._accumulates_into_parameters():
            self._start_pass()

    def _accumulates_into_parameters(self) -> bool:
        """Whether the running backward accumulates into a parameter's ``.grad``.

        Not ``torch.autograd.grad`` (a gradient penalty, say): that accumulates nothing, and
        the parameters' hooks, which stay the fallback start of a pass, do not fire then.
        """
        will_execute = getattr(torch._C, "_will_engine_execute_node", None)
        if will_execute is None:  # a torch without it: the first parameter hook starts it
            return False
        try:
            return any(map(will_execute, self._grad_accumulators))
        except RuntimeError:  # raised for AccumulateGrad nodes under torch.autograd.grad
            return False

    @property
    def _allow_unused(self) -> bool:
        """Parameters may go without a gradient (torch: find_unused_parameters or a static
        graph, whose unused set is found in the first iteration)."""
        return self.find_unused_parameters or self.static_graph

    def _set_static_graph(self) -> None:
        """Declares the graph static (torch's private API, which scripts call).

        As in torch, the graph must be the same every iteration; it is learnt in the first
        synchronised backward, which only counts how often each parameter's gradient hook
        fires and reduces every bucket at its end (its gradients are exact). From the second
        on, a parameter is ready when its hook has fired that often, so buckets launch during
        backward again: reentrant checkpointing (a block checkpointed twice, a weight shared
        with a checkpointed block) works, and parameters without a gradient in the first
        iteration are unused in every one, without ``find_unused_parameters``. A later
        backward that differs (a hook firing more, or fewer, times) raises on every rank.
        Call before the first synchronised backward.
        """
        if self._sequence or self._pass is not None:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel._set_static_graph: call it before "
                "the first synchronised backward (or pass static_graph=True)"
            )
        self.static_graph = True

    def will_sync_module_buffers(self) -> bool:
        """Whether forwards broadcast the module's buffers (torch's method)."""
        return self.broadcast_buffers and bool(self._module_buffers) and not self._local

    @property
    def process_group(self) -> Any:
        """The torch process group of the Communicator (torch's attribute)."""
        return getattr(self.comm, "group", None)

    def _unused_in_graph(self, output: Any) -> List[int]:
        """Parameters the autograd graph of ``output`` cannot reach (torch DDP's traversal)."""
        reached = set()
        stack = [t.grad_fn for t in tree_leaves(output) if torch.is_tensor(t) and t.grad_fn]
        reached.update(id(t) for t in tree_leaves(output) if torch.is_tensor(t) and t.is_leaf)
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                reached.add(id(variable))
            stack.extend(next_node for next_node, _ in node.next_functions)
        return [i for i, p in enumerate(self._params) if id(p) not in reached]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally, without comms."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Switches gradient synchronisation on or off, deciding for the next backward at once.

        Same name and use as torch FSDP2's switch, which it extends to DDP's forward-time
        decision (class docstring):

        * ``False``: the next backward does not synchronise, even if its forward already ran
          outside :meth:`no_sync`; while the switch stays off, forwards do not arm either, so
          no backward synchronises (gradients accumulate locally).
        * ``True``: the next backward synchronises, even if its forward ran inside
          :meth:`no_sync`; afterwards forwards arm as usual (outside ``no_sync()``).

        FSDP2-style accumulation calls it before each micro-batch's forward; a schedule that
        runs other backward passes between a forward and its backward (1F1B pipelines) calls
        it right before each backward::

            ddp.set_requires_gradient_sync(microbatch == last)
            torch.autograd.backward(outputs, grads)

        Call it between backward passes, not from inside one (``RuntimeError``: the running
        pass has already begun its reductions).
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                "requires_gradient_sync: expected a bool, got "
                f"{type(requires_gradient_sync).__name__}"
            )
        self._abandon_if_stale()
        if self._pass is not None:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel.set_requires_gradient_sync: called "
                "during a synchronised backward; call it before the backward it should affect"
            )
        self._sync_switch = self._armed = requires_gradient_sync
        if not requires_gradient_sync:
            self._unused_at_forward = []

    # ----------------------------------------------------------------- uneven inputs

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs across ranks (torch DDP's ``join``).

        Inside it, a rank that has run out of batches shadows the collectives of the ranks
        still training (zero gradients), so nobody hangs; on exit every rank has the
        parameters and buffers of the last rank to join. Gradients are divided by the
        initial world size (joined ranks contribute zeros), or with
        ``divide_by_initial_world_size=False`` by the number of ranks still training.
        ``throw_on_early_termination=True`` instead raises ``RuntimeError`` on every rank as
        soon as one has run out. Under ``join()`` the forward decides whether its backward
        synchronises (``set_requires_gradient_sync`` between forward and backward would
        leave joined ranks shadowing the wrong thing). See torch's
        ``torch.distributed.algorithms.Join``.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook :class:`torch.distributed.algorithms.Join` runs on a joined rank."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        """The torch process group of the Communicator (Join counts active ranks on it)."""
        return getattr(self.comm, "group", None)

    def _sync_buffers(self, active: bool) -> None:
        """Broadcasts buffers before a forward: from rank 0, or under join() from the highest
        rank still training (a joined rank's buffers stopped updating), as torch does."""
        if not self.broadcast_buffers or self._buffer_flat is None:
            return
        src = self._common_rank(active) if self._join_config.enable else 0
        _broadcast_bytes(self.comm, self._buffer_flat, self._module_buffers, src)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank for which ``candidate`` holds (every rank calls this)."""
        mine = torch.tensor([float(self.rank if candidate else -1)], device=self._device)
        self.comm.all_reduce(mine, op=ReduceOp.MAX)
        return int(mine.item())

    def _join_flag(self, mine: bool) -> bool:
        """Whether any rank said True (every rank calls this)."""
        if self._local:
            return mine
        flag = torch.tensor([float(mine)], device=self._device)
        self.comm.all_reduce(flag)
        return bool(flag.item() > 0)

    def _shadow_iteration(self) -> None:
        """A joined rank: the collectives of one iteration of the others, in their order."""
        self._abandon_if_stale()
        self._sync_buffers(active=False)
        if not self._join_flag(False) or self._local:
            return
        state = _BackwardPass(self._layouts, len(self._params), self._device)
        state.shadow = True
        self._pass = state
        try:
            self._launch_from(state, plan.STATUS_OK)
            self._wait_reductions(state)
            if not self._rebuilt:
                self._rebuild([])
        finally:
            self._pass = None

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After join: parameters and buffers from the last rank to join, on every rank."""
        if self._local:
            return
        src = self._common_rank(is_last_joiner)
        tensors = list(self.module.parameters()) + self._module_buffers
        flat = self._alloc_bytes(tensors)
        if flat is not None:
            _broadcast_bytes(self.comm, flat, tensors, src)

    def _rescale_for_joined(self) -> None:
        """``divide_by_initial_world_size=False``: the average over the active ranks only."""
        work, self._join_work = self._join_work, None
        if work is None:
            return
        work.wait()
        active = float(work.result()[0].item())
        if active < self.world_size:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.world_size / active)

    # ----------------------------------------------------------------- backward

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._abandon_if_stale()
            # A started pass finishes even if a forward re-decides meanwhile (non-reentrant
            # checkpointing recomputes forwards inside backward).
            if self._pass is None and not self._armed:
                return
            # An exception here leaves the pass for _abandon_pass (autograd then drops the
            # end-of-backward callback), which releases the peers waiting for our buckets.
            if self._pass is None:
                self._start_pass()
            self._gradient_arrived(index)

        return hook

    def _gradient_arrived(self, index: int) -> None:
        """Counts one firing of a parameter's hook; marks it ready at the last one expected.

        A hook fires once per backward pass the gradient flows through: more than once when
        reentrant checkpointing runs nested ones (torch's numGradHooksTriggeredMap_). Expected:
        once without a static graph; with one, the count of its first backward (which itself
        only counts, see :meth:`_set_static_graph`).
        """
        state = self._pass
        state.firings[index] += 1
        if state.counting:
            state.firing_order.append(index)
            return
        expected = 1 if self._static_firings is None else self._static_firings[index]
        if state.firings[index] > expected:
            raise RuntimeError(self._extra_gradient_message(index, expected))
        if state.firings[index] == expected:
            self._mark_ready(index, used=True)

    def _extra_gradient_message(self, index: int, expected: int) -> str:
        where = f"[rank {self.rank}] DistributedDataParallel: parameter '{self._names[index]}'"
        if self._static_firings is not None:
            return (
                f"{where} received {self._pass.firings[index]} gradient(s) in this backward, "
                f"{expected} in the first one; static_graph=True needs the same graph every "
                "iteration"
            )
        return (
            f"{where} received a gradient twice in one backward: it flows through more than "
            "one backward pass, as with reentrant checkpointing (torch.utils.checkpoint with "
            "use_reentrant=True) of a block that runs twice or shares a weight with the rest "
            "of the model. If the graph is the same every iteration, construct with "
            "static_graph=True (or call _set_static_graph()), as for torch DDP; "
            "use_reentrant=False also avoids it"
        )

    def _start_pass(self) -> None:
        self._pass = _BackwardPass(self._layouts, len(self._params), self._device)
        self._pass.counting = self.static_graph and self._static_firings is None
        inv_loss_scale = self._inv_loss_scale()
        self._pass.pre_scale = self._pre_scale
        if self._grad_views and inv_loss_scale is not None:
            self._pass.pre_scale *= inv_loss_scale
        end = _EndOfBackward(self._finish_backward)
        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._pass.end = weakref.ref(end)
        for index in self._unused_at_forward:
            self._mark_ready(index, used=False)

    def _abandon_pass(self) -> None:
        """Completes the collectives of a backward that autograd abandoned midway.

        An exception inside backward (a user's tensor hook, a failing op) stops autograd before
        the end-of-backward callback; peers are then waiting in the all-reduces of buckets this
        rank never launched. They are launched now, flagged ``STATUS_ABORTED``, and the results
        discarded; every peer's backward raises instead of waiting for the timeout, and every
        rank starts the next backward clean. Runs at this rank's next forward or gradient hook
        (or :meth:`close`). ``.grad`` of the abandoned step is unspecified: zero it.
        """
        state = self._pass
        try:
            if not self._local:
                self._launch_from(state, plan.STATUS_ABORTED)
                self._wait_reductions(state)
        finally:
            self._pass = None
            self._armed = False

    def _mark_ready(self, index: int, used: bool) -> None:
        state = self._pass
        if state.ready[index]:  # marked unused at the start (find_unused_parameters' walk)
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel: parameter '{self._names[index]}' "
                "received a gradient although the autograd graph of the forward's outputs does "
                "not reach it (find_unused_parameters), as inside reentrant checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True). If the graph is the same "
                "every iteration, construct with static_graph=True, as for torch DDP; "
                "use_reentrant=False also avoids it"
            )
        state.ready[index] = True
        state.used[index] = used
        if used:
            state.ready_order.append(index)
        if self._local:  # nothing to launch: _finish_local handles the gradients in place
            return
        state.pending[self._bucket_of[index]] -= 1
        while state.next_launch < len(self._layouts) and state.pending[state.next_launch] == 0:
            self._launch(state.next_launch, plan.STATUS_OK)
            state.next_launch += 1

    def _launch_from(self, state: _BackwardPass, status: int) -> None:
        """Launches every bucket not launched yet, with ``status`` in the status slots."""
        for bucket_index in range(state.next_launch, len(self._layouts)):
            self._launch(bucket_index, status)
        state.next_launch = len(self._layouts)

    def _launch(self, bucket_index: int, status: int) -> None:
        """Packs one bucket and starts its all-reduce asynchronously."""
        layout, bucket, state = self._layouts[bucket_index], self._buckets[bucket_index], self._pass
        if state.shadow:  # a joined rank contributes zeros
            bucket.zero_()
        else:
            self._fill(layout, bucket, state)
        if layout.status_offset is not None:
            slots = bucket[layout.status_offset : layout.status_offset + plan.STATUS_SLOTS]
            slots.copy_(torch.tensor(plan.status_slots(status, False), dtype=slots.dtype))
            # Read on the device: no host synchronisation for the flag.
            slots[plan.FOUND_INF_SLOT] = (state.found_inf > 0).to(slots.dtype)[0]
        state.status = max(state.status, status)
        if self._debug:
            self._check_fingerprint(layout, status)
        self._sequence += 1
        if self._comm_hook is not None:
            state.works[bucket_index] = self._run_comm_hook(bucket_index)
        else:
            state.works[bucket_index] = self._reductions.all_reduce(bucket)

    def _fill(self, layout: plan.BucketLayout, bucket: torch.Tensor, state: _BackwardPass) -> None:
        """This rank's gradients into the bucket, times the pre-scale; flags inf/NaN."""
        present, in_place = [], []
        for index, offset, size in zip(layout.param_indices, layout.offsets, layout.sizes):
            grad, view = self._params[index].grad, self._views[index]
            if grad is None:
                bucket[offset : offset + size].zero_()
            elif view is not None and _is_view(grad, view):  # accumulated in the bucket
                in_place.append(grad)
            else:
                present.append((grad.contiguous(), offset))
        # One pass each: scale (and cast) into the bucket, or scale in place; flag inf/NaN.
        for grads, offsets in _by_dtype(present):
            pack(grads, bucket, offsets, state.pre_scale, state.found_inf)
        if in_place:
            unscale_(in_place, state.pre_scale, state.found_inf)

    def _run_comm_hook(self, bucket_index: int) -> Tuple[torch.futures.Future, torch.Tensor]:
        """Hands one bucket (without its status slots) to the comm hook."""
        layout, bucket = self._layouts[bucket_index], self._buckets[bucket_index]
        end = layout.status_offset if layout.status_offset is not None else layout.numel
        grad_bucket = GradBucket(
            bucket_index,
            bucket[:end],
            [self._params[i] for i in layout.param_indices],
            layout.offsets,
            bucket_index == len(self._layouts) - 1,
            self._reductions,
        )
        future = self._comm_hook(self._comm_hook_state, grad_bucket)
        if not isinstance(future, torch._C.Future):  # then() returns the C++ base class
            raise TypeError(
                f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                f"{_hook_name(self._comm_hook)} returned {type(future).__name__} for bucket "
                f"{bucket_index}; it must return a torch.futures.Future of the reduced buffer"
            )
        return future, bucket[:end]

    def _check_fingerprint(self, layout: plan.BucketLayout, status: int) -> None:
        """DK_DEBUG=1: all ranks compare what they are about to all-reduce; raise on mismatch."""
        mine = plan.fingerprint(
            self._sequence, layout, DTYPE_CODES[layout.dtype], self._layout_id, status
        )
        out = torch.zeros(self.world_size * len(mine), dtype=torch.int64, device=self._device)
        self.comm.all_gather(out, torch.tensor(mine, dtype=torch.int64, device=self._device))
        message = plan.fingerprint_mismatch(out.view(self.world_size, -1).tolist())
        if message:
            note = self._missing_note() if status != plan.STATUS_OK else ""
            raise RuntimeError(f"[rank {self.rank}] {message}{note}")

    def _missing_note(self) -> str:
        missing = self._missing_params()
        if not missing:
            return ""
        return f". This rank got no gradient for: {', '.join(missing)}"

    def _missing_params(self) -> List[str]:
        if self._pass is None:
            return []
        return [self._names[i] for i, ready in enumerate(self._pass.ready) if not ready]

    def _finish_backward(self) -> None:
        """End of backward: launch the rest, wait, check the status slots, unpack into .grad."""
        state = self._pass
        if state is None:
            return
        try:
            if state.counting:
                self._mark_counted_ready(state)
            if self._local:
                self._finish_local(state)
            else:
                local_error = self._launch_remaining(state)
                status = self._wait_reductions(state)
                self._raise_on_status(local_error, status)
                self._unpack_all(status[plan.FOUND_INF_SLOT] > 0)
                self._rescale_for_joined()
                if not self._rebuilt:
                    self._rebuild(state.ready_order)
            if state.counting:  # every rank got here: no rank's first backward failed
                self._static_firings = list(state.firings)
        finally:
            self._pass = None
            self._armed = False

    def _wait_reductions(self, state: _BackwardPass) -> List[float]:
        """Waits for every collective of the pass; returns the summed status slots.

        Every rank issues the same collectives in the same order here, whether its backward
        finished, was incomplete or was abandoned (and a joined rank shadows them).
        """
        used_work = self._reduce_used_mask(state)
        if self._comm_hook is not None:
            status_work = self._reduce_hook_status(state)
            self._complete_hook_futures(state)
            status_work.wait()
        else:
            for work in state.works:
                work.wait()
        status = self._read_status()
        if used_work is not None:
            used_work.wait()
        return status

    def _reduce_hook_status(self, state: _BackwardPass) -> Any:
        """With a hook the buckets carry only gradients: the status slots travel alone."""
        slots = self._hook_status
        slots.copy_(torch.tensor(plan.status_slots(state.status, False), dtype=slots.dtype))
        slots[plan.FOUND_INF_SLOT] = (state.found_inf > 0).to(slots.dtype)[0]
        return self._reductions.all_reduce(slots)

    def _complete_hook_futures(self, state: _BackwardPass) -> None:
        """Completes the hooks' all-reduces in issue order, then copies each result in."""
        try:
            self._reductions.drain()
        except BaseException:
            self._reductions.discard()
            raise
        deadline = time.monotonic() + _seconds(self.comm)
        for bucket_index, (future, buffer) in enumerate(state.works):
            while not future.done():  # a torch.distributed future completes on its own
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                        f"{_hook_name(self._comm_hook)}'s Future for bucket {bucket_index} "
                        "did not complete within the communicator's timeout after all of its "
                        "all-reduces ran; the hook must complete it (e.g. from a then() callback)"
                    )
                time.sleep(1e-4)
            result = future.wait()
            if isinstance(result, (list, tuple)) and len(result) == 1:
                result = result[0]  # dist.all_reduce(...).get_future() yields a list
            self._take_hook_result(bucket_index, result, buffer)

    def _take_hook_result(self, bucket_index: int, result: Any, buffer: torch.Tensor) -> None:
        if not torch.is_tensor(result) or result.numel() != buffer.numel():
            got = tuple(result.shape) if torch.is_tensor(result) else type(result).__name__
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel: the comm hook "
                f"{_hook_name(self._comm_hook)}'s Future for bucket {bucket_index} holds {got}; "
                f"expected a tensor of the bucket buffer's {buffer.numel()} elements"
            )
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result.reshape(-1))

    def _raise_on_status(self, local_error: Optional[str], status: List[float]) -> None:
        if local_error:
            raise RuntimeError(local_error)
        if status[plan.ABORTED_SLOT] > 0:
            raise RuntimeError(self._aborted_error(status[plan.ABORTED_SLOT]))
        if status[plan.ERROR_SLOT] > 0:
            raise RuntimeError(self._peer_error(status[plan.ERROR_SLOT]))

    def _mark_counted_ready(self, state: _BackwardPass) -> None:
        """First static backward: the parameters whose hook fired are ready, in the order of
        their last firing (the order the buckets are then rebuilt in)."""
        last = {index: n for n, index in enumerate(state.firing_order)}
        for index in sorted(last, key=last.__getitem__):
            self._mark_ready(index, used=True)

    def _launch_remaining(self, state: _BackwardPass) -> Optional[str]:
        """Marks gradient-less parameters ready, or launches the rest flagged as an error."""
        unused, error = self._verdict_on_unready(state)
        for index in unused:
            self._mark_ready(index, used=False)
        if error:  # peers may be waiting on these buckets: send them, flagged, so all raise
            self._launch_from(state, plan.STATUS_INCOMPLETE)
        return error

    def _verdict_on_unready(self, state: _BackwardPass) -> Tuple[List[int], Optional[str]]:
        """(parameters to treat as unused, error) for those not ready at the end of backward."""
        missing = [i for i, ready in enumerate(state.ready) if not ready]
        if not missing:
            return [], None
        if self._static_firings is not None:  # a learnt static graph: unused, or an error
            unused = [i for i in missing if self._static_firings[i] == 0]
            short = [i for i in missing if self._static_firings[i] > 0]
            return unused, self._short_of_static_message(short, state) if short else None
        if self._allow_unused:
            return missing, None
        return [], self._no_gradient_message(missing)

    def _short_of_static_message(self, missing: Sequence[int], state: _BackwardPass) -> str:
        counts = ", ".join(
            f"'{self._names[i]}' ({state.firings[i]} of {self._static_firings[i]})" for i in missing
        )
        return (
            f"[rank {self.rank}] DistributedDataParallel: these parameters received fewer "
            f"gradients in this backward than in the first one: {counts}; static_graph=True "
            "needs the same graph every iteration"
        )

    def _no_gradient_message(self, missing: Sequence[int]) -> str:
        names = ", ".join(repr(self._names[i]) for i in missing)
        return (
            f"[rank {self.rank}] DistributedDataParallel: these parameters received no gradient "
            f"in this backward: {names}. Either make every parameter take part in the loss, "
            "or construct with find_unused_parameters=True."
        )

    def _finish_local(self, state: _BackwardPass) -> None:
        """One rank: check completeness, then unscale and flag inf/NaN in place (one pass).

        What reaches the optimizer equals the multi-rank result with one rank, and single-
        process training with ``scaler.unscale_``: every present ``.grad`` is multiplied by
        the inverse loss scale (1 without a scaler; the pass still finds inf/NaN for
        :attr:`found_inf`); unused parameters keep ``.grad`` untouched.
        """
        _, error = self._verdict_on_unready(state)
        if error:
            raise RuntimeError(error)
        inv_scale = self._inv_loss_scale()
        grads = [p.grad for p in self._params if p.grad is not None]
        _unscale_in_place(grads, 1.0 if inv_scale is None else inv_scale, state.found_inf)
        self.found_inf = bool(state.found_inf.item() > 0)
        if inv_scale is not None:
            self.loss_scaler.mark_unscaled(state.found_inf)

    def _reduce_used_mask(self, state: _BackwardPass) -> Any:
        if not self._allow_unused:
            return None
        self._used_mask[: len(state.used)].copy_(torch.tensor(state.used, dtype=torch.float32))
        return self._reductions.all_reduce(self._used_mask)

    def _read_status(self) -> List[float]:
        if self._comm_hook is not None:
            return self._hook_status.tolist()
        last = self._layouts[-1] if self._layouts else None
        if last is None:
            return [0.0] * plan.STATUS_SLOTS
        slots = self._buckets[-1][last.status_offset : last.status_offset + plan.STATUS_SLOTS]
        return slots.float().tolist()

    def _aborted_error(self, count: float) -> str:
        return (
            f"[rank {self.rank}] DistributedDataParallel: {int(round(count))} other rank(s) "
            "abandoned this backward midway (an exception there, e.g. from a user hook; see "
            "their error); this step's gradients are not averaged: zero them and carry on."
        )

    def _peer_error(self, count: float) -> str:
        return (
            f"[rank {self.rank}] DistributedDataParallel: {int(round(count))} other rank(s) "
            "had parameters without a gradient in this backward (their error names them); "
            "construct with find_unused_parameters=True if that is intended."
        )

    def _unpack_all(self, found_inf: bool) -> None:
        """Buckets back into .grad: cast, post-scale (and unscale), overwrite."""
        scale, inv_scale = self._post_scale, self._inv_loss_scale()
        if inv_scale is not None and not self._grad_views:  # else folded into the pre-scale
            scale *= inv_scale
        # Inf/NaN in what is written (e.g. an FP16 sum that overflowed although every rank's
        # inputs were finite); identical on every rank since the reduced buckets are.
        written_inf = torch.zeros(1, dtype=torch.float32, device=self._device)
        globally_used = self._used_mask.tolist() if self._allow_unused else None
        for layout, bucket in zip(self._layouts, self._buckets):
            targets, strided = [], []
            for index, offset in zip(layout.param_indices, layout.offsets):
                param = self._params[index]
                if globally_used is not None and globally_used[index] == 0:
                    continue
                if self._views[index] is not None:  # the view holds the result: point at it
                    param.grad = self._views[index]
                    continue
                if param.grad is None:
                    param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
                grad = param.grad
                if not grad.is_contiguous():  # unpack into a dense copy, then scatter
                    strided.append((grad, grad.contiguous()))
                    grad = strided[-1][1]
                targets.append((grad, offset))
            for grads, offsets in _by_dtype(targets):
                unpack(bucket, grads, offsets, scale, written_inf)
            for grad, dense in strided:
                grad.copy_(dense)
        self.found_inf = found_inf or bool(written_inf.item() > 0)
        if inv_scale is not None:
            self.loss_scaler.mark_unscaled(torch.tensor(float(self.found_inf), device=self._device))

    def _inv_loss_scale(self) -> Optional[float]:
        scaler = self.loss_scaler
        if scaler is None or not _scaler_enabled(scaler):
            return None
        return 1.0 / float(scaler.get_scale())

    def _rebuild(self, ready_order: Sequence[int]) -> None:
        """Re-plans buckets in rank 0's observed gradient-ready order (collective)."""
        self._rebuilt = True
        order = plan.rebuilt_order(ready_order, len(self._params))
        order = torch.tensor(order, dtype=torch.int64, device=self._device)
        if self.world_size > 1 and order.numel():
            self.comm.broadcast(order, 0)
        if order.tolist() != self._planned_order():
            self._set_layouts(order.tolist())

    def _planned_order(self) -> List[int]:
        return [i for b in self._layouts for i in b.param_indices]


DDP = DistributedDataParallel


def _check_options(
    module: nn.Module,
    bucket_cap_mb: float,
    first_bucket_mb: float,
    grad_dtype: Optional[torch.dtype],
    gradient_predivide_factor: Optional[float],
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
        raise ValueError(
            f"bucket_cap_mb ({bucket_cap_mb}) and first_bucket_mb ({first_bucket_mb}) must be > 0"
        )
    if grad_dtype not in _WIRE_DTYPES:
        raise TypeError(
            f"grad_dtype: expected None, float32, float16 or bfloat16, got {grad_dtype}"
        )
    if gradient_predivide_factor is not None and gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if any(p.is_sparse for p in module.parameters()):
        raise TypeError("module: sparse parameters are not supported")


def _check_devices(
    module: nn.Module, device_ids: Optional[Sequence[Any]], output_device: Any, dim: int
) -> None:
    """torch's rules: CPU modules take no device ids; a CUDA module at most its own device.

    The module stays where it is (nothing is moved or scattered), so the ids only have to
    agree with it; ``dim`` (the scatter dimension of torch's single-process multi-device
    mode) must be 0.
    """
    devices = {p.device for p in module.parameters()}
    if dim != 0:
        raise ValueError(
            f"DistributedDataParallel: dim must be 0 (nothing is scattered), got {dim}"
        )
    if device_ids is None and output_device is None:
        return
    cuda = [d for d in devices if d.type == "cuda"]
    if len(devices) != 1 or not cuda or (device_ids is not None and len(device_ids) != 1):
        raise ValueError(
            "DistributedDataParallel: device_ids and output_device work with single-device "
            f"CUDA modules only (as in torch), got device_ids {device_ids}, output_device "
            f"{output_device} and module parameters on {sorted(map(str, devices))}"
        )
    given_ids = (device_ids or [None])[0]
    for what, given in (("device_ids[0]", given_ids), ("output_device", output_device)):
        if given is not None and _as_cuda(given) != cuda[0]:
            raise ValueError(
                f"DistributedDataParallel: {what}={given} but the module is on {cuda[0]} "
                "(this DDP does not move modules)"
            )


def _as_cuda(device: Any) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _seconds(comm: Any) -> float:
    timeout = getattr(comm, "timeout", None)
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return 1800.0


def _is_view(grad: Optional[torch.Tensor], view: torch.Tensor) -> bool:
    return grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


def _by_dtype(
    pairs: Sequence[Tuple[torch.Tensor, int]],
) -> List[Tuple[List[torch.Tensor], List[int]]]:
    """(tensors, offsets) groups of one dtype each: the fused kernels take one input dtype."""
    groups: dict = {}
    for tensor, offset in pairs:
        grads, offsets = groups.setdefault(tensor.dtype, ([], []))
        grads.append(tensor)
        offsets.append(offset)
    return list(groups.values())


def _unscale_in_place(grads: Sequence[torch.Tensor], scale: float, found_inf: torch.Tensor) -> None:
    """``g *= scale`` for every gradient, setting ``found_inf`` on inf/NaN: one pass.

    The fused kernel takes contiguous tensors; strided ones go through torch's twin.
    """
    dense = [g for g in grads if g.is_contiguous()]
    if dense:
        unscale_(dense, scale, found_inf)
    strided = [(g, 0) for g in grads if not g.is_contiguous()]
    if strided:
        inv = torch.full((), scale, dtype=torch.float32, device=found_inf.device)
        for group, _ in _by_dtype(strided):
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)


def _scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _broadcast_bytes(
    comm: Any, flat: torch.Tensor, tensors: Sequence[torch.Tensor], src: int = 0
) -> None:
    """Rank ``src``'s bytes of ``tensors`` to every rank through one registered byte buffer."""
    views: List[Tuple[torch.Tensor, int, int]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        views.append((t, offset, nbytes))
        offset += nbytes
    if comm.rank == src:
        for t, start, nbytes in views:
            flat[start : start + nbytes].copy_(_as_bytes(t.detach()))
    comm.broadcast(flat, src)
    if comm.rank != src:
        with torch.no_grad():
            for t, start, nbytes in views:
                _copy_bytes_into(t, flat[start : start + nbytes])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy_bytes_into(t: torch.Tensor, data: torch.Tensor) -> None:
    if t.is_contiguous():
        t.reshape(-1).view(torch.uint8).copy_(data)
    else:
        t.copy_(data.view(t.dtype).view(t.shape))
