"""DistributedDataParallel: bucketed gradient all-reduce overlapped with backward.

Drop-in for ``torch.nn.parallel.DistributedDataParallel`` where the options mean the same::

    model = dk.DDP(module, bucket_cap_mb=25, grad_dtype=torch.bfloat16)
    loss = model(x).sum(); loss.backward()        # .grad now holds the mean over ranks
    with model.no_sync(): model(x2).sum().backward()   # accumulate locally

How one backward runs (details in docs/ddp.md):

1. A post-accumulate-grad hook marks each parameter ready. When a bucket's last gradient is
   ready (and every earlier bucket has been launched, so all ranks issue collectives in the same
   order), its gradients are brought into the bucket multiplied by 1 / world_size (cast to a
   low-precision wire dtype, or, when ``.grad`` already is a view of the bucket, scaled in
   place; one fused pass that also flags inf/NaN) and its all-reduce starts asynchronously,
   overlapping the rest of backward.
2. A callback queued on the autograd engine runs when backward ends: it launches what is left
   (parameters without gradients under ``find_unused_parameters``), waits, and points ``.grad``
   at its bucket view (same dtype on the wire) or unpacks into it (cast back, one pass).
3. After the first synchronised backward the buckets are re-planned in the order gradients
   actually became ready on rank 0, broadcast so that all ranks agree.

The last bucket carries two status elements summed by its own all-reduce: "found inf" (for loss
scaling, so skipping a step costs no extra collective) and "incomplete backward" (a rank had a
parameter without a gradient: every rank raises instead of one hanging).

Whether a backward synchronises is decided before it starts: by its forward (not inside
``no_sync()``), or by :meth:`DistributedDataParallel.set_requires_gradient_sync`, whichever ran
last; while that switch is off, forwards do not arm at all.

On one rank nothing is bucketed or sent: a synchronised backward only checks that every
parameter got a gradient, unscales for the loss scaler and flags inf/NaN, in place.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from .. import comm as communicator
from ..amp.bucketing import pack, plan_buckets, unpack, unscale_
from ..dtypes import DTYPE_CODES, ReduceOp
from . import plan

__all__ = ["DistributedDataParallel", "DDP"]

_WIRE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)
_MB = 1024 * 1024


def _default_comm(module: nn.Module) -> Tuple[Any, bool]:
    """(communicator, created here): the default one if ``dk.init()`` ran, else a new one."""
    try:
        return communicator.get_default_communicator(), False
    except RuntimeError:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        return communicator.Communicator(device="cuda" if device.type == "cuda" else "cpu"), True


class _BackwardPass:
    """Bookkeeping of one synchronised backward."""

    def __init__(
        self, layouts: Sequence[plan.BucketLayout], num_params: int, device: torch.device
    ) -> None:
        self.pending = [len(b.param_indices) for b in layouts]
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.ready_order: List[int] = []
        self.next_launch = 0
        self.works: List[Any] = [None] * len(layouts)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.pre_scale = 1.0


class DistributedDataParallel(nn.Module):
    """Data parallelism over a dist_kernels Communicator, with torch DDP's options.

    Which backward passes synchronise: a backward all-reduces when it is *armed* as it starts.
    Three things set the arming, the last one to run wins:

    * a forward with gradients enabled arms when run outside :meth:`no_sync` with the gradient
      sync switch on, and disarms otherwise (a forward under ``torch.no_grad()`` changes
      nothing);
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
    ) -> None:
        super().__init__()
        _check_options(
            module, bucket_cap_mb, first_bucket_mb, grad_dtype, gradient_predivide_factor
        )
        self.module = module
        self.comm, self._owns_comm = (comm, False) if comm is not None else _default_comm(module)
        self._device = torch.device(getattr(self.comm, "device", "cpu"))
        self.world_size = self.comm.world_size
        self.rank = self.comm.rank
        self._local = self.world_size == 1  # nothing to reduce: gradients stay in place
        self.grad_dtype = grad_dtype
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.loss_scaler = loss_scaler
        self._bucket_cap_bytes = int(bucket_cap_mb * _MB)
        self._first_bucket_bytes = int(first_bucket_mb * _MB)
        # Gradients are multiplied by 1 / factor on their way into the bucket (fused with the
        # copy or cast, so FP16 partial sums stay in range), summed, and by factor / world_size
        # on the way out. When that is 1 and the wire dtype is the parameters' own (FP32 or
        # BF16), contiguous parameters' .grad become views of the registered buckets and nothing
        # is copied out; the inverse loss scale then joins the pre-scale too.
        factor = float(gradient_predivide_factor or self.world_size)
        self._pre_scale, self._post_scale = 1.0 / factor, factor / self.world_size
        self._grad_views = (
            not self._local
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
        self._broadcast_state(list(module.parameters()) + self._module_buffers)
        self._buffer_flat = self._alloc_bytes(self._module_buffers)

        self._require_backward_grad_sync = True  # False inside no_sync()
        self._armed = False  # whether the next backward synchronises
        self._sync_switch = True  # set_requires_gradient_sync; persistent, like FSDP2's
        self._unused_at_forward: List[int] = []
        self._pass: Optional[_BackwardPass] = None
        self._sequence = 0
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
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for param, view in zip(self._params, self._views):
            if view is not None and _is_view(param.grad, view):
                param.grad = view.clone()
        if self._owns_comm and hasattr(self.comm, "close"):
            self.comm.close()

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
        deciding = torch.is_grad_enabled()
        if deciding:
            self._armed = self._require_backward_grad_sync and self._sync_switch
        if self.broadcast_buffers and self._buffer_flat is not None:
            _broadcast_bytes(self.comm, self._buffer_flat, self._module_buffers)
        output = self.module(*args, **kwargs)
        if deciding:
            # Only an overlap optimisation (see _start_pass): the end of backward finds any
            # parameter still without a gradient, so a later set_requires_gradient_sync(True)
            # after a no_sync() forward stays correct with the empty list.
            track = self._armed and self.find_unused_parameters and not self._local
            self._unused_at_forward = self._unused_in_graph(output) if track else []
        return output

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
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

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
        if self._pass is not None:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel.set_requires_gradient_sync: called "
                "during a synchronised backward; call it before the backward it should affect"
            )
        self._sync_switch = self._armed = requires_gradient_sync
        if not requires_gradient_sync:
            self._unused_at_forward = []

    # ----------------------------------------------------------------- backward

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            # A started pass finishes even if a forward re-decides meanwhile (non-reentrant
            # checkpointing recomputes forwards inside backward).
            if self._pass is None and not self._armed:
                return
            try:
                if self._pass is None:
                    self._start_pass()
                self._mark_ready(index, used=True)
            except BaseException:
                self._pass = None
                self._armed = False
                raise

        return hook

    def _start_pass(self) -> None:
        self._pass = _BackwardPass(self._layouts, len(self._params), self._device)
        inv_loss_scale = self._inv_loss_scale()
        self._pass.pre_scale = self._pre_scale
        if self._grad_views and inv_loss_scale is not None:
            self._pass.pre_scale *= inv_loss_scale
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        for index in self._unused_at_forward:
            self._mark_ready(index, used=False)

    def _mark_ready(self, index: int, used: bool) -> None:
        state = self._pass
        if state.ready[index]:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel: parameter '{self._names[index]}' "
                "received a gradient twice in one backward (reentrant checkpointing or a "
                "second backward through the same forward); use no_sync() for the extra passes"
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

    def _launch(self, bucket_index: int, status: int) -> None:
        """Packs one bucket and starts its all-reduce asynchronously."""
        layout, bucket, state = self._layouts[bucket_index], self._buckets[bucket_index], self._pass
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
        if layout.status_offset is not None:
            slots = bucket[layout.status_offset : layout.status_offset + plan.STATUS_SLOTS]
            slots[plan.FOUND_INF_SLOT] = (state.found_inf > 0).to(slots.dtype)[0]
            slots[plan.ERROR_SLOT] = float(status != plan.STATUS_OK)
        if self._debug:
            self._check_fingerprint(layout, status)
        self._sequence += 1
        state.works[bucket_index] = self.comm.all_reduce(
            bucket, op=ReduceOp.SUM, algorithm=self.algorithm, async_op=True
        )

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
        if state is None:  # a hook raised and abandoned this backward
            return
        if self._local:
            try:
                self._finish_local(state)
            finally:
                self._pass = None
                self._armed = False
            return
        try:
            local_error = self._launch_remaining(state)
            used_work = self._reduce_used_mask(state)
            for work in state.works:
                work.wait()
            status = self._read_status()
            if local_error or status[plan.ERROR_SLOT] > 0:
                raise RuntimeError(local_error or self._peer_error(status[plan.ERROR_SLOT]))
            if used_work is not None:
                used_work.wait()
            self._unpack_all(status[plan.FOUND_INF_SLOT] > 0)
            if not self._rebuilt:
                self._rebuild(state.ready_order)
        finally:
            self._pass = None
            self._armed = False

    def _launch_remaining(self, state: _BackwardPass) -> Optional[str]:
        """Marks gradient-less parameters ready, or launches the rest flagged as an error."""
        missing = [i for i, ready in enumerate(state.ready) if not ready]
        if not missing:
            return None
        if self.find_unused_parameters:
            for index in missing:
                self._mark_ready(index, used=False)
            return None
        # Peers may be waiting on these buckets: send them, flagged, so every rank raises.
        for bucket_index in range(state.next_launch, len(self._layouts)):
            self._launch(bucket_index, plan.STATUS_INCOMPLETE)
        state.next_launch = len(self._layouts)
        return self._no_gradient_message(missing)

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
        missing = [i for i, ready in enumerate(state.ready) if not ready]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(self._no_gradient_message(missing))
        inv_scale = self._inv_loss_scale()
        grads = [p.grad for p in self._params if p.grad is not None]
        _unscale_in_place(grads, 1.0 if inv_scale is None else inv_scale, state.found_inf)
        self.found_inf = bool(state.found_inf.item() > 0)
        if inv_scale is not None:
            self.loss_scaler.mark_unscaled(state.found_inf)

    def _reduce_used_mask(self, state: _BackwardPass) -> Any:
        if not self.find_unused_parameters:
            return None
        self._used_mask[: len(state.used)].copy_(torch.tensor(state.used, dtype=torch.float32))
        return self.comm.all_reduce(self._used_mask, op=ReduceOp.SUM, async_op=True)

    def _read_status(self) -> List[float]:
        last = self._layouts[-1] if self._layouts else None
        if last is None:
            return [0.0] * plan.STATUS_SLOTS
        slots = self._buckets[-1][last.status_offset : last.status_offset + plan.STATUS_SLOTS]
        return slots.float().tolist()

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
        globally_used = self._used_mask.tolist() if self.find_unused_parameters else None
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


def _broadcast_bytes(comm: Any, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0's bytes of ``tensors`` to every rank through one registered byte buffer."""
    views: List[Tuple[torch.Tensor, int, int]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        views.append((t, offset, nbytes))
        offset += nbytes
    if comm.rank == 0:
        for t, start, nbytes in views:
            flat[start : start + nbytes].copy_(_as_bytes(t.detach()))
    comm.broadcast(flat, 0)
    if comm.rank != 0:
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
