"""BackwardSync: when a DDP backward synchronises, and what its start and end do.

The buckets themselves are the :class:`~dist_kernels.buckets.reducer.BucketReducer`'s
(``ddp.reducer``); this part is the autograd side that drives it, as torch's ``_DDPSink`` and the
hook half of its Reducer do:

* arming: whether the next backward synchronises (``armed``, set by the engine's forward and
  ``set_requires_gradient_sync``; the end of a synchronised backward disarms);
* the pass start: where the backward reaches the forward's outputs (so its end-of-backward
  callback belongs to the outermost backward, even under reentrant checkpointing), else at the
  first parameter's hook; parameters found unused at forward count as ready with zeros;
* a post-accumulate-grad hook per parameter, counting its firings (more than one per backward
  under reentrant checkpointing; a static graph's first backward only counts them) and telling
  the reducer ``grad_ready`` at the last one expected;
* the end-of-backward callback: parameters still without a gradient are unused (or an error,
  sent flagged so every rank raises), then the reducer waits, the summed status slots decide
  whether anyone failed, the reducer unpacks, the loss scaler learns the verdict, and the first
  synchronised backward re-plans the buckets in the order rank 0 saw gradients arrive;
* a backward autograd abandoned midway (an exception) is completed, flagged aborted, at the
  next call in, so peers raise instead of waiting.

It reads nothing of the engine: the reducer, the parameters and the options come in at
construction; the engine sets ``armed``, ``join_work`` and calls :meth:`prepare`.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..buckets import plan
from ..buckets.all_reduce import BucketMismatch

__all__ = ["BackwardSync"]

_OWNER = "DistributedDataParallel"


class _Firings:
    """How often each parameter's hook fired in one synchronised backward."""

    def __init__(self, num_params: int, counting: bool) -> None:
        self.firings = [0] * num_params
        #: First iteration of a static graph: hooks only count (``order`` records each firing);
        #: everything is reduced at the end, and the counts are kept for later passes.
        self.counting = counting
        self.order: List[int] = []
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


class BackwardSync:
    """DDP's autograd side over its bucket reducer (module docstring).

    Args:
        reducer: the engine's bucket reducer.
        named_params: the parameters that require gradients, with their names (the reducer's
            parameter order).
        comm: the engine's Communicator (its rank and world size; the reducer communicates).
        find_unused_parameters: parameters may go without a gradient (torch's option).
        static_graph: the graph is the same every iteration (torch's option; see
            :meth:`set_static_graph`).
        loss_scaler: a LossScaler, or None.
    """

    def __init__(
        self,
        reducer: Any,
        named_params: Sequence[Tuple[str, torch.Tensor]],
        comm: Any,
        find_unused_parameters: bool,
        static_graph: bool,
        loss_scaler: Any,
    ) -> None:
        self.reducer = reducer
        self._names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        self._rank, self._world_size = comm.rank, comm.world_size
        self._device = torch.device(getattr(comm, "device", "cpu"))
        self.find_unused_parameters = find_unused_parameters
        self.loss_scaler = loss_scaler
        #: torch's attribute: True when constructed so or after :meth:`set_static_graph`.
        self.static_graph = static_graph
        #: Static graph: per parameter, how often its hook fired in the first synchronised
        #: backward (0: unused); None until that backward completed on every rank.
        self._static_firings: Optional[List[int]] = None
        #: Whether the next backward synchronises.
        self.armed = False
        #: The Join all-reduce counting the active ranks (``divide_by_initial_world_size=False``).
        self.join_work: Any = None
        #: Whether the last synchronised backward had an inf/NaN gradient on any rank.
        self.found_inf = False
        self._unused_at_forward: List[int] = []
        self._pass: Optional[_Firings] = None
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]
        with torch.enable_grad():  # the parameters' AccumulateGrad nodes (autograd keeps one)
            self._grad_accumulators = [
                p.view_as(p).grad_fn.next_functions[0][0] for p in self._params
            ]

    # ----------------------------------------------------------------- the engine's calls

    @property
    def in_pass(self) -> bool:
        return self._pass is not None

    @property
    def allow_unused(self) -> bool:
        """Parameters may go without a gradient (torch: find_unused_parameters or a static
        graph, whose unused set is found in the first iteration)."""
        return self.find_unused_parameters or self.static_graph

    def arm(self, armed: bool) -> None:
        """Decides now whether the next backward synchronises (``set_requires_gradient_sync``)."""
        self.armed = armed
        if not armed:
            self._unused_at_forward = []

    def set_static_graph(self) -> None:
        """Declares the graph static (see ``DistributedDataParallel._set_static_graph``)."""
        if self.reducer.launched or self._pass is not None:
            raise RuntimeError(
                f"[rank {self._rank}] {_OWNER}._set_static_graph: call it before the first "
                "synchronised backward (or pass static_graph=True)"
            )
        self.static_graph = True

    def prepare(self, output: Any) -> None:
        """After a forward with gradients enabled: the armed backward starts its pass where it
        reaches ``output``, and the parameters ``output`` cannot reach count as unused then.

        The unused list is only an overlap optimisation (see :meth:`_start_pass`): the end of
        backward finds any parameter still without a gradient, so a later
        ``set_requires_gradient_sync(True)`` after a ``no_sync()`` forward stays correct."""
        self._hook_outputs(output)
        self._unused_at_forward = self._unused_for(output)

    def abandon_if_stale(self) -> None:
        if self._pass is not None and self._pass.abandoned():
            self._abandon_pass()

    def close(self) -> None:
        """Removes the gradient hooks."""
        self.abandon_if_stale()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # ----------------------------------------------------------------- the pass start

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
        self.abandon_if_stale()
        if self._pass is None and self.armed and self._accumulates_into_parameters():
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

    def _unused_for(self, output: Any) -> List[int]:
        """Parameters to mark ready (unused) when the armed backward starts."""
        if not self.armed or self._world_size == 1 or not self.allow_unused:
            return []
        if not self.static_graph:
            return self._unused_in_graph(output)
        # A static graph's unused parameters are those without a gradient in its first
        # backward (until then, none: they are found at its end). Not the graph walk, which
        # misses parameters inside reentrant checkpoints (recomputed during backward).
        return [i for i, n in enumerate(self._static_firings or []) if n == 0]

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

    def _start_pass(self) -> None:
        counting = self.static_graph and self._static_firings is None
        self._pass = _Firings(len(self._params), counting)
        self.reducer.begin(inv_loss_scale=self._inv_loss_scale())
        end = _EndOfBackward(self._finish_backward)
        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._pass.end = weakref.ref(end)
        for index in self._unused_at_forward:
            self._mark_ready(index, used=False)

    # ----------------------------------------------------------------- gradients

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self.abandon_if_stale()
            # A started pass finishes even if a forward re-decides meanwhile (non-reentrant
            # checkpointing recomputes forwards inside backward).
            if self._pass is None and not self.armed:
                return
            # An exception here leaves the pass for _abandon_pass (autograd then drops the
            # end-of-backward callback), which releases the peers waiting for our buckets.
            if self._pass is None:
                self._start_pass()
            self._gradient_arrived(index)

        # ShardedOptimizer refuses parameters whose hooks say they are DDP's.
        hook.__qualname__ = f"{_OWNER}.gradient_hook"
        return hook

    def _gradient_arrived(self, index: int) -> None:
        """Counts one firing of a parameter's hook; marks it ready at the last one expected.

        A hook fires once per backward pass the gradient flows through: more than once when
        reentrant checkpointing runs nested ones (torch's numGradHooksTriggeredMap_). Expected:
        once without a static graph; with one, the count of its first backward (which itself
        only counts).
        """
        state = self._pass
        state.firings[index] += 1
        if state.counting:
            state.order.append(index)
            return
        expected = 1 if self._static_firings is None else self._static_firings[index]
        if state.firings[index] > expected:
            raise RuntimeError(self._extra_gradient_message(index, expected))
        if state.firings[index] == expected:
            self._mark_ready(index, used=True)

    def _mark_ready(self, index: int, used: bool) -> None:
        if self.reducer.is_ready(index):  # marked unused at the start (the forward's walk)
            raise RuntimeError(
                f"[rank {self._rank}] {_OWNER}: parameter '{self._names[index]}' received a "
                "gradient although the autograd graph of the forward's outputs does not reach "
                "it (find_unused_parameters), as inside reentrant checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True). If the graph is the same "
                "every iteration, construct with static_graph=True, as for torch DDP; "
                "use_reentrant=False also avoids it"
            )
        self.reducer.grad_ready(index, used)

    def _mark_counted_ready(self, state: _Firings) -> None:
        """First static backward: the parameters whose hook fired are ready, in the order of
        their last firing (the order the buckets are then rebuilt in)."""
        last = {index: n for n, index in enumerate(state.order)}
        for index in sorted(last, key=last.__getitem__):
            self._mark_ready(index, used=True)

    # ----------------------------------------------------------------- the end

    def _finish_backward(self) -> None:
        """End of backward: the rest is unused (or an error), wait, check, unpack, hand off."""
        state = self._pass
        if state is None:
            return
        try:
            if state.counting:
                self._mark_counted_ready(state)
            local_error = self._launch_remaining(state)
            status = self.reducer.wait(used_mask=self.allow_unused)
            ready_order = self.reducer.ready_order
            self.reducer.end()
            self._raise_on_status(local_error, status)
            inv_scale = self._inv_loss_scale()
            self.found_inf = self.reducer.unpack(status, inv_scale)
            if inv_scale is not None:
                found = torch.tensor(float(self.found_inf), device=self._device)
                self.loss_scaler.mark_unscaled(found)
            self._rescale_for_joined()
            self.reducer.rebuild(ready_order)
            if state.counting:  # every rank got here: no rank's first backward failed
                self._static_firings = list(state.firings)
        finally:
            self.reducer.end()
            self._pass = None
            self.armed = False

    def _launch_remaining(self, state: _Firings) -> Optional[str]:
        """Marks gradient-less parameters ready, or launches the rest flagged as an error."""
        unused, error = self._verdict_on_unready(state)
        for index in unused:
            self._mark_ready(index, used=False)
        if error:  # peers may be waiting on these buckets: send them, flagged, so all raise
            self._launch_flagged(plan.STATUS_INCOMPLETE)
        return error

    def _launch_flagged(self, status: int) -> None:
        """Every bucket not launched yet, with ``status``; a DK_DEBUG mismatch names what this
        rank is missing."""
        try:
            self.reducer.launch_rest(status)
        except BucketMismatch as e:
            missing = [self._names[i] for i in self.reducer.unready()]
            note = f". This rank got no gradient for: {', '.join(missing)}" if missing else ""
            raise BucketMismatch(f"{e}{note}") from None

    def _abandon_pass(self) -> None:
        """Completes the collectives of a backward that autograd abandoned midway.

        An exception inside backward (a user's tensor hook, a failing op) stops autograd before
        the end-of-backward callback; peers are then waiting in the all-reduces of buckets this
        rank never launched. They are launched now, flagged ``STATUS_ABORTED``, and the results
        discarded; every peer's backward raises instead of waiting for the timeout, and every
        rank starts the next backward clean. Runs at this rank's next forward or gradient hook
        (or ``close()``). ``.grad`` of the abandoned step is unspecified: zero it.
        """
        try:
            self._launch_flagged(plan.STATUS_ABORTED)
            self.reducer.wait(used_mask=self.allow_unused)
        finally:
            self.reducer.end()
            self._pass = None
            self.armed = False

    def _verdict_on_unready(self, state: _Firings) -> Tuple[List[int], Optional[str]]:
        """(parameters to treat as unused, error) for those not ready at the end of backward."""
        missing = self.reducer.unready()
        if not missing:
            return [], None
        if self._static_firings is not None:  # a learnt static graph: unused, or an error
            unused = [i for i in missing if self._static_firings[i] == 0]
            short = [i for i in missing if self._static_firings[i] > 0]
            return unused, self._short_of_static_message(short, state) if short else None
        if self.allow_unused:
            return missing, None
        return [], self._no_gradient_message(missing)

    def _raise_on_status(self, local_error: Optional[str], status: List[float]) -> None:
        if local_error:
            raise RuntimeError(local_error)
        if status[plan.ABORTED_SLOT] > 0:
            raise RuntimeError(
                f"[rank {self._rank}] {_OWNER}: {int(round(status[plan.ABORTED_SLOT]))} other "
                "rank(s) abandoned this backward midway (an exception there, e.g. from a user "
                "hook; see their error); this step's gradients are not averaged: zero them and "
                "carry on."
            )
        if status[plan.ERROR_SLOT] > 0:
            raise RuntimeError(
                f"[rank {self._rank}] {_OWNER}: {int(round(status[plan.ERROR_SLOT]))} other "
                "rank(s) had parameters without a gradient in this backward (their error names "
                "them); construct with find_unused_parameters=True if that is intended."
            )

    def _rescale_for_joined(self) -> None:
        """``divide_by_initial_world_size=False``: the average over the active ranks only."""
        work, self.join_work = self.join_work, None
        if work is None:
            return
        work.wait()
        active = float(work.result()[0].item())
        if active < self._world_size:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self._world_size / active)

    def _inv_loss_scale(self) -> Optional[float]:
        scaler = self.loss_scaler
        if scaler is None or not _scaler_enabled(scaler):
            return None
        return 1.0 / float(scaler.get_scale())

    # ----------------------------------------------------------------- messages

    def _extra_gradient_message(self, index: int, expected: int) -> str:
        where = f"[rank {self._rank}] {_OWNER}: parameter '{self._names[index]}'"
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

    def _short_of_static_message(self, missing: Sequence[int], state: _Firings) -> str:
        counts = ", ".join(
            f"'{self._names[i]}' ({state.firings[i]} of {self._static_firings[i]})" for i in missing
        )
        return (
            f"[rank {self._rank}] {_OWNER}: these parameters received fewer gradients in this "
            f"backward than in the first one: {counts}; static_graph=True needs the same graph "
            "every iteration"
        )

    def _no_gradient_message(self, missing: Sequence[int]) -> str:
        names = ", ".join(repr(self._names[i]) for i in missing)
        return (
            f"[rank {self._rank}] {_OWNER}: these parameters received no gradient in this "
            f"backward: {names}. Either make every parameter take part in the loss, or "
            "construct with find_unused_parameters=True."
        )


def _scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
