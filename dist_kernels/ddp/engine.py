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

Where the code lives: this module is the engine itself (construction, the bucket allocation,
the forward and the arming of the next backward, torch's attributes and methods);
``ddp/reducer.py`` runs a synchronised backward (hooks, readiness, bucket launch / wait /
unpack, the end-of-backward callback), ``ddp/join.py`` the uneven-inputs side,
``ddp/options.py`` checks the constructor's arguments and picks the Communicator, and
``ddp/broadcast.py`` copies rank 0's parameters and buffers to every rank.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils._pytree import tree_leaves

from ..buckets import plan
from ..buckets.plan import plan_buckets
from ..buckets.reductions import Reductions
from .broadcast import _broadcast_bytes
from .join import _UnevenInputs
from .options import _check_devices, _check_options, _resolve_comm
from .reducer import _BackwardPass, _hook_name, _is_view, _Reducer
from .structure import describe_parameters, first_description_mismatch

__all__ = ["DistributedDataParallel", "DDP"]

_MB = 1024 * 1024


class DistributedDataParallel(_Reducer, _UnevenInputs, nn.Module, Joinable):
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
            for entry, (_, p) in zip(describe_parameters(named), named)
        ]
        entries += ["buffer " + e for e in describe_parameters(list(self.module.named_buffers()))]
        per_rank = self._all_gather_bytes("\n".join(entries).encode())
        message = first_description_mismatch([b.decode().split("\n") for b in per_rank])
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
            for index, offset, size in zip(b.param_indices, b.offsets, b.counts):
                param = self._params[index]
                if self._grad_views and param.is_contiguous():
                    self._views[index] = bucket[offset : offset + size].view(param.shape)
        self._attach_views(self._params_with_grad())

    def _set_no_buckets(self) -> None:
        """One rank: no plan, no buckets, no views (``.grad`` stays where autograd puts it)."""
        #: The bucket plan (printable), in launch order; None on one rank.
        self.bucket_plan = None
        self._layouts: List[plan.Bucket] = []
        self._layout_id = 0
        self._bucket_of = {}
        self._buckets: List[torch.Tensor] = []
        self._views = [None] * len(self._params)

    def _plan(self, order: Sequence[int]) -> List[plan.Bucket]:
        #: The bucket plan (printable), in launch order; None on one rank.
        self.bucket_plan = plan_buckets(
            list(zip(self._names, self._params)),
            cap_bytes=self._bucket_cap_bytes,
            dtype=self.grad_dtype,
            first_bucket_bytes=self._first_bucket_bytes,
            order=list(order),
        )
        return plan.with_status_slots(self.bucket_plan.buckets)

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
    def bucket_layouts(self) -> List[plan.Bucket]:
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


DDP = DistributedDataParallel
