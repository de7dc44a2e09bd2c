"""The Reducer of DistributedDataParallel: what one synchronised backward does (torch's name).

A gradient hook per parameter counts its firings and marks it ready (at its last expected
firing; a static graph's first backward only counts); buckets launch in plan order as they
fill (packed, or handed to a comm hook); the end-of-backward callback queued on autograd
launches the rest, waits, checks the status slots every rank summed and unpacks into
``.grad``; the first synchronised backward re-plans the buckets in rank 0's ready order. A
backward that autograd abandoned midway is completed (flagged aborted) at the next call in.

``_Reducer`` is a mixin of :class:`dist_kernels.ddp.engine.DistributedDataParallel`, not an
object the engine holds: its methods read and write the engine's state directly (``_pass``,
``_layouts``, ``_buckets``, ``_params``, ``_views``, ``_comm_hook``, ...), as they did when
they were the engine's own. A composed Reducer would need every one of them rewritten to
reach that state through a reference, so they moved verbatim instead; the state is set up by
the engine's ``__init__`` and ``_set_layouts``.
"""

from __future__ import annotations

import datetime
import time
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..buckets import plan
from ..buckets.comm_hook import GradBucket
from ..buckets.kernels import pack, unpack, unscale_
from ..dtypes import DTYPE_CODES


class _BackwardPass:
    """Bookkeeping of one synchronised backward."""

    def __init__(
        self, layouts: Sequence[plan.Bucket], num_params: int, device: torch.device
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


class _Reducer:
    """The backward half of DistributedDataParallel (mixin; see the module docstring)."""

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

    def _fill(self, layout: plan.Bucket, bucket: torch.Tensor, state: _BackwardPass) -> None:
        """This rank's gradients into the bucket, times the pre-scale; flags inf/NaN."""
        present, in_place = [], []
        for index, offset, size in zip(layout.param_indices, layout.offsets, layout.counts):
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

    def _check_fingerprint(self, layout: plan.Bucket, status: int) -> None:
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
