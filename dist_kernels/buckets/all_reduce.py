"""DDP's buckets on an all-reduce: the collectives a :class:`BucketReducer` drives for DDP.

* :class:`GradientBuckets`: the memory. One registered tensor per bucket (``comm.empty``, so the
  all-reduce reads and writes it in place), the last with the status slots after its
  gradients, and ``.grad`` views into it where the wire is the parameters' own dtype.
* :class:`AllReduce`: the built-in reduction. At launch, this rank's gradients go into the
  bucket times ``1 / factor`` (one fused pass that casts and flags inf/NaN; or, when ``.grad``
  already is the bucket view, scaled in place), the status slots get this rank's status, and a
  SUM all-reduce starts. At the end it waits, and unpacks: ``.grad`` points at its view, or
  the sum is cast back times ``factor / world_size`` (and the inverse loss scale).
  ``comm_hook.CommHook`` is the same with the bucket handed to a hook instead.
* :class:`InPlace`: one rank. Nothing is bucketed or sent; unpacking unscales the gradients in
  place (one pass) and flags inf/NaN.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..dtypes import DTYPE_CODES
from . import plan
from .kernels import pack, unpack, unscale_
from .plan import Bucket
from .reductions import Reductions

__all__ = ["AllReduce", "BucketMismatch", "GradientBuckets", "InPlace"]


class BucketMismatch(RuntimeError):
    """DK_DEBUG=1: ranks were about to reduce different buckets (their fingerprints differ)."""


class GradientBuckets:
    """DDP's bucket memory: registered tensors, ``.grad`` views, gradients packed in and out.

    Args:
        comm: allocates the buckets (``comm.empty``).
        params: the parameters, indexed as the plan's slots.
        views: make contiguous parameters' ``.grad`` views of their slots.
    """

    def __init__(self, comm: Any, params: Sequence[torch.Tensor], views: bool) -> None:
        self._comm = comm
        self.params = list(params)
        self.grad_views = views
        self.device = torch.device(getattr(comm, "device", "cpu"))
        self.layouts: List[Bucket] = []
        self.tensors: List[torch.Tensor] = []
        self.views: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self.layout_id = 0
        #: Which parameters had a gradient, summed over ranks (find_unused_parameters).
        self.used_mask = comm.empty((max(1, len(self.params)),), torch.float32)

    def allocate(self, buckets: Sequence[Bucket]) -> List[Bucket]:
        """Lays out (status slots in the last bucket) and allocates ``buckets`` (collective);
        ``.grad`` that exist move into their new views."""
        layouts = plan.with_status_slots(buckets)
        self.layouts = layouts
        self.layout_id = plan.layout_signature(layouts)
        self.tensors = [self._comm.empty((b.numel,), b.dtype) for b in layouts]
        for bucket in self.tensors:
            bucket.zero_()
        self.views = [None] * len(self.params)
        for b, bucket in zip(layouts, self.tensors):
            for index, offset, size in zip(b.param_indices, b.offsets, b.counts):
                param = self.params[index]
                if self.grad_views and param.is_contiguous():
                    self.views[index] = bucket[offset : offset + size].view(param.shape)
        self._attach_views([i for i, p in enumerate(self.params) if p.grad is not None])
        return layouts

    def _attach_views(self, indices: Sequence[int]) -> None:
        """Points .grad of these parameters at their bucket views (copying current values)."""
        with torch.no_grad():
            for index in indices:
                view, param = self.views[index], self.params[index]
                if view is None or _is_view(param.grad, view):
                    continue
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view

    def detach_views(self) -> None:
        """``.grad`` that are bucket views become copies (the buckets may go away)."""
        for param, view in zip(self.params, self.views):
            if view is not None and _is_view(param.grad, view):
                param.grad = view.clone()

    def fill(self, b: int, scale: float, found_inf: torch.Tensor) -> None:
        """This rank's gradients into bucket ``b``, times ``scale``; flags inf/NaN."""
        layout, bucket = self.layouts[b], self.tensors[b]
        present, in_place = [], []
        for index, offset, size in zip(layout.param_indices, layout.offsets, layout.counts):
            grad, view = self.params[index].grad, self.views[index]
            if grad is None:
                bucket[offset : offset + size].zero_()
            elif view is not None and _is_view(grad, view):  # accumulated in the bucket
                in_place.append(grad)
            else:
                present.append((grad.contiguous(), offset))
        # One pass each: scale (and cast) into the bucket, or scale in place; flag inf/NaN.
        for grads, offsets in _by_dtype(present):
            pack(grads, bucket, offsets, scale, found_inf)
        if in_place:
            unscale_(in_place, scale, found_inf)

    def write_status(self, b: int, status: int, found_inf: torch.Tensor) -> None:
        """This rank's status into bucket ``b``'s status slots, if it has them."""
        layout = self.layouts[b]
        if layout.status_offset is not None:
            slots = self.tensors[b][layout.status_offset : layout.status_offset + plan.STATUS_SLOTS]
            write_status(slots, status, found_inf)

    def read_status(self) -> List[float]:
        """The status slots of the last bucket (after its all-reduce: every rank's sum)."""
        if not self.layouts:
            return [0.0] * plan.STATUS_SLOTS
        last = self.layouts[-1]
        slots = self.tensors[-1][last.status_offset : last.status_offset + plan.STATUS_SLOTS]
        return slots.float().tolist()

    def unpack(self, scale: float, used: Optional[List[float]], found_inf: torch.Tensor) -> None:
        """Buckets back into .grad: cast, scale, overwrite; parameters unused on every rank
        (``used[i] == 0``) keep theirs; flags inf/NaN in what is written."""
        for layout, bucket in zip(self.layouts, self.tensors):
            targets, strided = [], []
            for index, offset in zip(layout.param_indices, layout.offsets):
                param = self.params[index]
                if used is not None and used[index] == 0:
                    continue
                if self.views[index] is not None:  # the view holds the result: point at it
                    param.grad = self.views[index]
                    continue
                if param.grad is None:
                    param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
                grad = param.grad
                if not grad.is_contiguous():  # unpack into a dense copy, then scatter
                    strided.append((grad, grad.contiguous()))
                    grad = strided[-1][1]
                targets.append((grad, offset))
            for grads, offsets in _by_dtype(targets):
                unpack(bucket, grads, offsets, scale, found_inf)
            for grad, dense in strided:
                grad.copy_(dense)


class AllReduce:
    """The reducer's collective for DDP: every bucket summed by one all-reduce.

    Args:
        buckets: the bucket memory.
        reductions: issues (and counts) the all-reduces.
        predivide: gradients are multiplied by ``1 / predivide`` on their way in and by
            ``predivide / world_size`` on the way out (None: ``world_size``, all on the way in).
        debug: DK_DEBUG=1: every rank compares fingerprints before each bucket's all-reduce.
        rank: for messages.
    """

    def __init__(
        self,
        buckets: GradientBuckets,
        reductions: Reductions,
        *,
        predivide: Optional[float] = None,
        debug: bool = False,
        rank: int = 0,
    ) -> None:
        world_size = reductions.comm.world_size
        factor = float(predivide or world_size)
        self.predivide = predivide
        self.memory = buckets
        self.reductions = reductions
        self.device = buckets.device
        self.pre_scale, self.post_scale = 1.0 / factor, factor / world_size
        self.debug = debug
        self.rank, self._world_size = rank, world_size
        self._pass_scale = self.pre_scale
        self._shadow = False
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._globally_used: Optional[List[float]] = None

    @property
    def bytes_sent(self) -> int:
        return self.reductions.bytes

    @property
    def tensors(self) -> List[torch.Tensor]:
        """The registered bucket tensors, in launch order."""
        return self.memory.tensors

    def detach_views(self) -> None:
        self.memory.detach_views()

    def allocate(self, buckets: Sequence[Bucket]) -> List[Bucket]:
        return self.memory.allocate(buckets)

    def begin(self, *, shadow: bool = False, inv_loss_scale: Optional[float] = None) -> None:
        """A pass starts: a fresh inf/NaN flag; with bucket views the inverse loss scale joins
        the pre-scale (so nothing is multiplied on the way out)."""
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._pass_scale = self.pre_scale
        if self.memory.grad_views and inv_loss_scale is not None:
            self._pass_scale *= inv_loss_scale
        self._shadow = shadow

    def deliver(self, b: int, slot: Any) -> None:
        """Nothing: the gradient stays in ``.grad`` (or its view) until the bucket launches."""

    def launch(self, b: int, status: int, sequence: int, group: Any) -> Any:
        """Packs bucket ``b`` (zeros on a joined rank), writes its status, starts its all-reduce."""
        self._prepare(b, status, sequence)
        return self._start(b, group)

    def _prepare(self, b: int, status: int, sequence: int) -> None:
        if self._shadow:  # a joined rank contributes zeros
            self.memory.tensors[b].zero_()
        else:
            self.memory.fill(b, self._pass_scale, self.found_inf)
        self.memory.write_status(b, status, self.found_inf)
        if self.debug:
            self._check_fingerprint(b, status, sequence)

    def _start(self, b: int, group: Any) -> Any:
        return self.reductions.all_reduce(self.memory.tensors[b], group)

    def wait(self, handles: Dict[int, Any], status: int, used: Optional[List[bool]]) -> Any:
        """Waits for every bucket (and the used mask: which parameters some rank used);
        returns the summed status slots."""
        used_work = self._reduce_used_mask(used) if used is not None else None
        summed = self._wait_buckets(handles, status)
        if used_work is not None:
            used_work.wait()
        self._globally_used = self.memory.used_mask.tolist() if used is not None else None
        return summed

    def _wait_buckets(self, handles: Dict[int, Any], status: int) -> List[float]:
        for work in handles.values():
            work.wait()
        return self.memory.read_status()

    def complete(self, b: int, handle: Any) -> None:
        handle.wait()

    def _reduce_used_mask(self, used: List[bool]) -> Any:
        mask = self.memory.used_mask
        mask[: len(used)].copy_(torch.tensor(used, dtype=torch.float32))
        return self.reductions.all_reduce(mask)

    def unpack(self, status: List[float], inv_loss_scale: Optional[float]) -> bool:
        """The sums back into ``.grad`` (times the post-scale, and the inverse loss scale unless
        it was folded into the pre-scale); returns whether any rank had an inf/NaN."""
        scale = self.post_scale
        if inv_loss_scale is not None and not self.memory.grad_views:
            scale *= inv_loss_scale
        # Inf/NaN in what is written (e.g. an FP16 sum that overflowed although every rank's
        # inputs were finite); identical on every rank since the reduced buckets are.
        written_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.memory.unpack(scale, self._globally_used, written_inf)
        return status[plan.FOUND_INF_SLOT] > 0 or bool(written_inf.item() > 0)

    def _check_fingerprint(self, b: int, status: int, sequence: int) -> None:
        """All ranks compare what they are about to reduce; raise on mismatch."""
        layout = self.memory.layouts[b]
        mine = plan.fingerprint(
            sequence, layout, DTYPE_CODES[layout.dtype], self.memory.layout_id, status
        )
        out = torch.zeros(self._world_size * len(mine), dtype=torch.int64, device=self.device)
        comm = self.reductions.comm
        comm.all_gather(out, torch.tensor(mine, dtype=torch.int64, device=self.device))
        message = plan.fingerprint_mismatch(out.view(self._world_size, -1).tolist())
        if message:
            raise BucketMismatch(f"[rank {self.rank}] {message}")


class InPlace:
    """The reducer's collective on one rank: nothing to reduce, nothing bucketed.

    What reaches the optimizer equals the multi-rank result with one rank, and single-process
    training with ``scaler.unscale_``: every present ``.grad`` is multiplied by the inverse loss
    scale (1 without a scaler; the pass still finds inf/NaN); unused parameters keep ``.grad``.
    """

    def __init__(self, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.params = list(params)
        self.device = device
        self.bytes_sent = 0
        self.tensors: List[torch.Tensor] = []
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)

    def detach_views(self) -> None:
        """Nothing: on one rank ``.grad`` stays where autograd put it."""

    def allocate(self, buckets: Sequence[Bucket]) -> List[Bucket]:
        return []

    def begin(self, *, shadow: bool = False, inv_loss_scale: Optional[float] = None) -> None:
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)

    def wait(self, handles: Dict[int, Any], status: int, used: Optional[List[bool]]) -> Any:
        return [0.0] * plan.STATUS_SLOTS

    def unpack(self, status: List[float], inv_loss_scale: Optional[float]) -> bool:
        """Unscales and checks every present gradient in place, one pass."""
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = 1.0 if inv_loss_scale is None else inv_loss_scale
        _unscale_in_place(grads, scale, self.found_inf)
        return bool(self.found_inf.item() > 0)


def write_status(slots: torch.Tensor, status: int, found_inf: torch.Tensor) -> None:
    """This rank's status into the status slots; found-inf read on the device (no host sync)."""
    slots.copy_(torch.tensor(plan.status_slots(status, False), dtype=slots.dtype))
    slots[plan.FOUND_INF_SLOT] = (found_inf > 0).to(slots.dtype)[0]


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
