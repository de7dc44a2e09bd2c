"""ShardedOptimizer: ZeRO stages 1, 2 and 3 on a dist_kernels Communicator.

    opt = dk.ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    opt = dk.ShardedOptimizer(model.parameters(), FusedAdamW, stage=3, module=model, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Every parameter lives in a flat buffer (one per param group and dtype; at stage 3 one per unit
of modules, param group and dtype) laid out by the pure plan of ``partition.py``: buckets split
into equal, aligned per-rank slices. Rank ``r`` owns slice ``r`` of every bucket; the
concatenation of its slices is its *shard*: the only parameters its optimizer steps and the only
optimizer state it holds. The local optimizer steps one tensor per bucket slice: for FP32
parameters a view of the values themselves (no copy of the shard), for 16-bit parameters a view
of one FP32 master shard. How one iteration runs:

1. Backward. A post-accumulate-grad hook of ours reports each parameter ready to
   ``self.reducer``, a :class:`dist_kernels.buckets.reducer.BucketReducer` (the object DDP's
   buckets use too) driving a ``buckets.reduce_scatter.ReduceScatter``: buckets are
   reduce-scattered in plan order (the same order on every rank) as soon as all their gradients
   are in, asynchronously, so communication overlaps the rest of backward. *Stage 1* keeps the
   full gradients (``.grad`` are views of one flat gradient buffer) and reduce-scatters each
   bucket in place: this rank's slice of the buffer becomes its gradient shard. *Stages 2 and
   3* copy each gradient into one of two bucket-sized staging buffers (cast to ``grad_dtype``
   on the way) and free ``.grad`` at once; the bucket is reduce-scattered into the gradient
   shard. A callback at the end of backward has the reducer launch what is left and wait.
2. ``step()``: the local optimizer steps the shard (16-bit shards one bucket at a time, through
   one FP32 bucket-slice buffer), then stages 1 and 2 all-gather every bucket back in place.
   Stage 3 keeps only the shard: ``stage3.py`` gathers each unit's full parameters just
   before its forward and again before its backward, and frees them after.

Loss scaling: ``dk.LossScaler(comm=opt.comm)`` used as ``torch.amp.GradScaler`` is calls
``opt._unscale_grads_``: it checks the gradient shards for inf/NaN (FP32 shards are unscaled in
place; 16-bit ones keep their scale until the step converts them, so FP16 does not underflow)
and all-reduces the flag, so an overflow on any rank's shard skips the step on every rank.
Without ``comm`` the ranks would disagree and the next collective would hang.

Reduce-scatters average (``ReduceOp.AVG``) with FP32 accumulation inside the collective; a 16-bit
``grad_dtype`` halves the bytes on the wire.

Expert parallelism (``expert_comm``): the parameters of sharded MoE experts (marked
``expert_parallel``) differ across the ep ranks, so they live in flat groups of their own,
sharded, reduce-scattered, all-gathered and broadcast over ``expert_comm`` (the replicas of this
rank's experts, ``mesh.expert_dp_comm``); dense parameters over ``comm`` as before. An expert's
gradient already sums its ep group's tokens (the all-to-all's backward), so its average over
``expert_comm`` is scaled by ``expert_comm.world_size / comm.world_size`` (= 1 / ep): the same
division by dp that the dense average makes. Every element is still owned by one rank of
``comm`` (an expert shard by one replica, the ep ranks holding different experts), so the
gradient norm and the inf/NaN flag all-reduced over ``comm`` stay global.

Model parallelism: with tensor or pipeline parallelism ``comm`` is one of many data-parallel
groups, each sharding its own part of the model. ``clip_grad_norm_`` then needs the rest of
the model's norm: ``tp_comm`` and ``pp_comm`` add it (see the constructor).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Type

import torch

from ..buckets.reduce_scatter import STAGING_SLOTS, ReduceScatter, ShardTarget
from ..buckets.reducer import BucketReducer
from ..dtypes import ReduceOp
from ..pipeline.tied import is_tied_copy
from ..tensor_parallel.layers import is_tensor_parallel_shard
from . import memory
from .partition import FlatGroupPlan, ParamSpec, PartitionPlan, Segment, plan_flat_group

__all__ = ["ShardedOptimizer"]

_MB = 1024 * 1024
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _default_comm() -> Any:
    """The default communicator (``dk.init()``), else a new one over the default group."""
    from ..comm import Communicator, get_default_communicator

    try:
        return get_default_communicator()
    except RuntimeError:
        return Communicator()


@dataclass
class _FlatGroup:
    """The buffers of one flat group on this rank."""

    plan: FlatGroupPlan
    params: List[torch.nn.Parameter]  # in plan slot order
    comm: Any  # the ranks that share its shards (``comm``, or ``expert_comm`` for experts)
    dtype: torch.dtype  # parameter dtype
    wire_dtype: torch.dtype  # reduce-scatter dtype
    # Full values; the model's parameters view it. Stages 1, 2: registered, kept. Stage 3: a
    # plain tensor whose storage is freed (resized to 0) between uses, so views stay valid.
    flat: torch.Tensor
    pieces: List[torch.nn.Parameter] = field(default_factory=list)  # stepped: one per bucket
    values: Optional[torch.Tensor] = None  # stage 3: this rank's shard of the values
    master: Optional[torch.Tensor] = None  # 16-bit parameters: FP32 master shard
    grad_flat: Optional[torch.Tensor] = None  # stage 1: the full gradient buffer (registered)
    grad_shard: Optional[torch.Tensor] = None  # stages 2, 3: this rank's gradient shard
    unit: int = 0  # stage 3: the unit of modules that gathers this group
    grad_scale: float = 1.0  # applied to the averaged gradient (experts: 1 / ep)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO optimizer: state and master weights sharded (stage 1), gradients too (stage 2),
    parameters too (stage 3).

    Args:
        params: the model's parameters or parameter groups (as for any torch optimizer); the
            same model on every rank. Their storage moves into flat buffers.
        optimizer_class: any ``torch.optim`` optimizer, run on this rank's shard;
            :class:`dist_kernels.optim.FusedAdamW` is the fast path (one kernel per bucket).
        comm: a :class:`dist_kernels.Communicator`; default: the one ``dk.init()`` made, else a
            new one over torch.distributed's default group.
        stage: 1 (optimizer state sharded, full gradients kept), 2 (gradients sharded too) or
            3 (parameters sharded too: needs ``module``).
        grad_dtype: reduce-scatter dtype (``torch.bfloat16`` / ``torch.float16`` halve the wire
            bytes; accumulation stays FP32); None keeps each parameter's dtype.
        bucket_cap_mb: bucket size in MiB: the unit of one reduce-scatter and all-gather.
        overlap: launch reduce-scatters during backward (True) or all at the end of it.
        module: stage 3: the model whose forward uses ``params``; its forward hooks gather
            the parameters.
        units: stage 3: the submodules whose parameters are gathered together (as FSDP's
            ``fully_shard`` per block); None: each child no bigger than ``bucket_cap_mb``,
            splitting only containers (``Sequential``, ``ModuleList``, ``ModuleDict``) and the
            root. Parameters outside every unit belong to the root.
        expert_comm: the Communicator over which parameters marked ``expert_parallel``
            (``dk.moe`` experts sharded over ep) are sharded and reduced: their replicas, a
            subgroup of ``comm`` (``mesh.expert_dp_comm`` with ``comm=mesh.dp_comm``), as for
            ``dk.DDP``. Without it such parameters are refused.
        tp_comm: the tensor-parallel ranks of this replica (``mesh.tp_comm``), for
            :meth:`clip_grad_norm_`: the norm sums over them, counting a parameter they all
            hold whole (one not marked ``tensor_parallel_shard``) on tp rank 0 only, as
            Megatron's distributed optimizer does.
        pp_comm: the pipeline stages of this replica (``mesh.pp_comm``), for
            :meth:`clip_grad_norm_`: each holds other parameters, so the norm sums over them.
        **optimizer_kwargs: passed to ``optimizer_class`` (lr, betas, momentum, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
        comm: Any = None,
        *,
        stage: int = 2,
        grad_dtype: Optional[torch.dtype] = None,
        bucket_cap_mb: float = 25,
        overlap: bool = True,
        module: Optional[torch.nn.Module] = None,
        units: Optional[Iterable[torch.nn.Module]] = None,
        expert_comm: Any = None,
        tp_comm: Any = None,
        pp_comm: Any = None,
        **optimizer_kwargs: Any,
    ) -> None:
        _check_arguments(stage, grad_dtype, bucket_cap_mb, module, units)
        self.comm = comm if comm is not None else _default_comm()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        _check_expert_comm(self.comm, expert_comm)
        self.expert_comm = expert_comm
        self.tp_comm, self.pp_comm = tp_comm, pp_comm
        self.stage, self.grad_dtype, self.overlap = stage, grad_dtype, overlap
        self.bucket_cap_bytes = int(bucket_cap_mb * _MB)
        groups = _param_groups(params)
        for p in (p for g in groups for p in g["params"]):
            _refuse_ddp(p)
            if expert_comm is None:
                _refuse_experts(p, self.comm)
        self._gatherer = None
        unit_of = None
        if stage == 3:
            from .stage3 import ParameterGatherer

            self._gatherer = ParameterGatherer(module, units, self.bucket_cap_bytes)
            unit_of = self._gatherer.unit_of_param
        self.plan, self.flat_groups = self._build_flat_groups(groups, unit_of)
        #: Owns the gradient buckets through backward (readiness, reduce-scatters, waiting).
        self.reducer = self._make_reducer()
        self._step_grad = self._step_grad_buffer()
        local_groups = [
            {**_group_options(groups[gi]), "params": fg.pieces}
            for gi, fg in zip(self._group_of, self.flat_groups)
        ]
        self.optim = optimizer_class(local_groups, **optimizer_kwargs)
        super().__init__([p for fg in self.flat_groups for p in fg.pieces], self.optim.defaults)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._sync = True
        self._callback_queued = False
        self._grad_factor = 1.0  # pending unscale / clip factor of 16-bit gradient shards
        for p in self._all_params():
            p._dk_sharded_optimizer = True  # lets dk.DistributedDataParallel refuse these params
        units_of = [fg.unit for fg in self.flat_groups for _ in fg.params]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i, unit))
            for i, (p, unit) in enumerate(zip(self._all_params(), units_of))
        ]
        if stage == 1:
            self._hooks += [
                p.register_hook(self._make_reopen_hook(i)) for i, p in enumerate(self._all_params())
            ]
        if self._gatherer is not None:
            self._gatherer.attach(self.flat_groups)

    # ----------------------------------------------------------------- construction

    def _build_flat_groups(
        self, groups: List[Dict[str, Any]], unit_of: Optional[Callable[[Any], int]]
    ) -> Tuple[PartitionPlan, List[_FlatGroup]]:
        """Plans and allocates the flat buffers (collective: every rank, same order).

        Stages 1, 2: one flat group per (param group, dtype). Stage 3: one per (unit, param
        group, dtype), units in reverse order, so that plan order follows backward. Expert
        parameters (with ``expert_comm``) make groups of their own, keyed ``.../experts`` and
        planned for ``expert_comm``'s world size."""
        members, self._group_of, units = [], [], []
        keyed: Dict[Tuple[int, int, torch.dtype, bool], List[torch.nn.Parameter]]
        keyed = defaultdict(list)
        for gi, group in enumerate(groups):
            for p in group["params"]:
                unit = unit_of(p) if unit_of is not None else 0
                keyed[(unit, gi, p.dtype, self._is_expert(p))].append(p)
        order = sorted(keyed, key=lambda k: (-k[0], k[1], k[3])) if unit_of else list(keyed)
        plans = []
        for unit, gi, dtype, expert in order:
            # reverse registration order: the last layers' gradients arrive first
            plist = list(reversed(keyed[(unit, gi, dtype, expert)]))
            key = f"{gi}/{str(dtype).replace('torch.', '')}"
            if unit_of is not None:
                key = f"u{unit}/{key}"
            if expert:
                key = f"{key}/experts"
            spec = [ParamSpec(f"{key}/{i}", tuple(p.shape), p.numel()) for i, p in enumerate(plist)]
            comm = self.expert_comm if expert else self.comm
            plans.append(
                plan_flat_group(
                    key, spec, plist[0].element_size(), comm.world_size, self.bucket_cap_bytes
                )
            )
            members.append((dtype, plist, comm))
            self._group_of.append(gi)
            units.append(unit)
        plan = PartitionPlan(self.world_size, tuple(plans))
        flat_groups = [
            self._allocate(gplan, dtype, plist, unit, comm)
            for gplan, (dtype, plist, comm), unit in zip(plan.groups, members, units)
        ]
        return plan, flat_groups

    def _is_expert(self, p: torch.Tensor) -> bool:
        """Sharded over ``expert_comm``: an MoE expert's parameter, when one is given."""
        return self.expert_comm is not None and getattr(p, "expert_parallel", False)

    def _allocate(
        self,
        plan: FlatGroupPlan,
        dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        unit: int,
        comm: Any,
    ) -> _FlatGroup:
        """The flat group's values (its ``comm``'s rank 0's everywhere), shard views and
        gradient storage."""
        if self.stage == 3:
            flat = torch.empty((plan.numel,), dtype=dtype, device=params[0].device)
        else:
            flat = comm.empty((plan.numel,), dtype)
        flat.zero_()
        with torch.no_grad():
            for slot, p in zip(plan.slots, params):
                flat[slot.offset : slot.offset + slot.numel].copy_(p.reshape(-1))
            if comm.world_size > 1:
                comm.broadcast(flat, 0)  # every rank starts from rank 0's values
            for slot, p in zip(plan.slots, params):
                p.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        fg = _FlatGroup(plan, params, comm, dtype, self.grad_dtype or dtype, flat, unit=unit)
        fg.grad_scale = comm.world_size / self.world_size
        if self.stage == 3:
            fg.values = comm.empty((plan.shard_numel,), dtype)
            fg.values.copy_(self._gather_shard(fg, flat))
            flat.untyped_storage().resize_(0)  # the full values exist only while gathered
        if dtype != torch.float32:
            fg.master = self._gather_shard(fg, flat if fg.values is None else None, master=True)
        if self.stage == 1:
            fg.grad_flat = comm.empty((plan.numel,), dtype)
            fg.grad_flat.zero_()
            for slot, p in zip(plan.slots, params):
                p.grad = self._grad_view(fg, slot.index)
        else:
            fg.grad_shard = comm.empty((plan.shard_numel,), dtype)
            fg.grad_shard.zero_()
        for b in range(len(plan.buckets)):  # what the optimizer steps: views, no copies
            fg.pieces.append(torch.nn.Parameter(self._shard_slice(fg, b, fg.master)))
        self._set_piece_grads(fg)
        return fg

    def _gather_shard(
        self, fg: _FlatGroup, flat: Optional[torch.Tensor], master: bool = False
    ) -> torch.Tensor:
        """This rank's slices of ``flat`` (or of ``fg.values``), concatenated, in FP32 for
        the ``master`` shard."""
        if flat is None:
            return fg.values.to(torch.float32)
        parts = [
            flat[b.slice_start(fg.rank) : b.slice_start(fg.rank) + b.slice_numel]
            for b in fg.plan.buckets
        ]
        return torch.cat(parts).to(torch.float32 if master else flat.dtype)

    def _shard_slice(
        self, fg: _FlatGroup, b: int, source: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """This rank's slice of bucket ``b``: of ``source`` (shard-shaped) if given, else of
        the values in their own dtype (the flat buffer at stages 1, 2; the shard at 3)."""
        bucket = fg.plan.buckets[b]
        if source is None and fg.values is None:
            lo = bucket.slice_start(fg.rank)
            return fg.flat[lo : lo + bucket.slice_numel]
        source = fg.values if source is None else source
        return source[bucket.shard_offset : bucket.shard_offset + bucket.slice_numel]

    def _shard_grad(self, fg: _FlatGroup, b: int) -> torch.Tensor:
        """This rank's reduced gradient of bucket ``b`` (in the parameter dtype)."""
        bucket = fg.plan.buckets[b]
        if fg.grad_flat is not None:
            lo = bucket.slice_start(fg.rank)
            return fg.grad_flat[lo : lo + bucket.slice_numel]
        return fg.grad_shard[bucket.shard_offset : bucket.shard_offset + bucket.slice_numel]

    def _set_piece_grads(self, fg: _FlatGroup) -> None:
        """FP32 pieces hold their gradient shard as ``.grad`` (a view: no copy); 16-bit
        pieces get an FP32 gradient only while they step."""
        for b, piece in enumerate(fg.pieces):
            piece.grad = self._shard_grad(fg, b) if fg.master is None else None

    def _make_reducer(self) -> BucketReducer:
        """The bucket reducer over every flat group's buckets, in plan order, each
        reduce-scattered into this rank's gradient shard (collective: staging memory)."""
        buckets, targets, first_param = [], [], 0
        for fg in self.flat_groups:
            for bucket in fg.plan.buckets:
                full = None
                if fg.grad_flat is not None:
                    full = fg.grad_flat[bucket.start : bucket.start + bucket.numel]
                shard = self._shard_grad(fg, bucket.index)
                targets.append(ShardTarget(shard, fg.wire_dtype, full, fg.comm, fg.grad_scale))
                buckets.append(bucket.renumbered(len(buckets), first_param))
            first_param += len(fg.params)
        views = None
        if self.stage == 1:
            views = [
                self._grad_view(fg, s) for fg in self.flat_groups for s in range(len(fg.params))
            ]
        params = list(self._all_params())
        rs = ReduceScatter(self.comm, params, targets, stage=self.stage, grad_views=views)
        return BucketReducer(rs, buckets, len(params), comm=self.comm, window=rs.window)

    def _step_grad_buffer(self) -> Optional[torch.Tensor]:
        """One FP32 bucket slice to step 16-bit shards through (None without them)."""
        slices = [
            b.slice_numel
            for fg in self.flat_groups
            if fg.master is not None
            for b in fg.plan.buckets
        ]
        return torch.empty(max(slices), dtype=torch.float32) if slices else None

    def _all_params(self) -> Iterator[torch.nn.Parameter]:
        for fg in self.flat_groups:
            yield from fg.params

    def _grad_view(self, fg: _FlatGroup, s: int) -> torch.Tensor:
        slot = fg.plan.slots[s]
        return fg.grad_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # ----------------------------------------------------------------- backward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication; the
        first backward outside (or ``step()``) reduces the accumulated gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _make_hook(self, index: int, unit: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._gatherer is not None:
                self._gatherer.grad_ready(unit)
            if not self._sync:
                return
            if not self.reducer.in_pass:
                _refuse_ddp(param)  # a DDP wrapped after us would reduce a second time
                self.reducer.begin()
            self._queue_end_of_backward()
            if self.overlap and not self.reducer.is_ready(index):
                self.reducer.grad_ready(index)

        return hook

    def _queue_end_of_backward(self) -> None:
        """Makes ``_end_backward`` run when the current backward ends (call from inside it)."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _make_reopen_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """Stage 1, before a gradient accumulates onto a buffer reduced in place: see
        ``ReduceScatter.reopen``."""

        def hook(grad: torch.Tensor) -> None:
            reduce_scatter = self.reducer.collective
            if reduce_scatter.reduced_in_place:
                for b in self.reducer.buckets_of(index):
                    reduce_scatter.reopen(b)

        return hook

    def _end_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            self._finish_pass()

    def _finish_pass(self) -> None:
        """Delivers what backward left (unused parameters count as zero gradients), launches
        the remaining buckets in order and waits for every reduce-scatter."""
        if not self.reducer.in_pass:
            self.reducer.begin()
        self.reducer.finish()

    # ----------------------------------------------------------------- step

    def _reduced(self) -> None:
        """Makes sure the shard gradients hold this iteration's reduced gradients."""
        if self.reducer.in_pass or not self.reducer.collective.holds_reduced:
            self._finish_pass()

    def _shard_grads(self) -> Iterator[Tuple[_FlatGroup, torch.Tensor]]:
        for fg in self.flat_groups:
            for b in range(len(fg.plan.buckets)):
                yield fg, self._shard_grad(fg, b)

    def _unscale_grads_(self, inv_scale: torch.Tensor) -> torch.Tensor:
        """For :class:`dist_kernels.LossScaler`: this rank's found-inf flag (FP32, 0 or 1) over
        its gradient shards. FP32 shards are multiplied by ``inv_scale`` in place; 16-bit shards
        keep their scale, applied when the step converts them to FP32 (an FP16 gradient
        unscaled in FP16 would underflow)."""
        self._reduced()
        found = torch.zeros((), dtype=torch.bool)
        for fg, grad in self._shard_grads():
            found |= ~torch.isfinite(grad).all()
            if fg.master is None:
                grad.mul_(inv_scale.to(grad.dtype))
        if any(fg.master is not None for fg in self.flat_groups):
            self._grad_factor *= float(inv_scale)
        return found.to(torch.float32)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the gradients so that the model's norm is at most ``max_norm``; returns the
        norm before clipping, the same on every rank. Each rank sums over its shard (every
        element owned by one rank of ``comm``), then one all-reduce over ``comm`` and, when
        given, one over ``tp_comm`` and one over ``pp_comm`` (the rest of the model)."""
        self._reduced()
        norm_type = float(norm_type)
        pieces = list(self._counted_grads())
        if math.isinf(norm_type):
            local = torch.zeros((), dtype=torch.float64)
            for g, f in pieces:
                local = torch.maximum(local, g.abs().max().double() * f)
            op = ReduceOp.MAX
        else:
            local = torch.zeros((), dtype=torch.float64)
            for g, f in pieces:
                local += g.double().abs().pow(norm_type).sum() * f**norm_type
            op = ReduceOp.SUM
        local = local.reshape(1)
        for comm in (self.comm, self.tp_comm, self.pp_comm):
            if comm is not None and comm.world_size > 1:
                comm.all_reduce(local, op=op)
        total = local[0] if math.isinf(norm_type) else local[0] ** (1.0 / norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for fg, g in self._shard_grads():
                if fg.master is None:
                    g.mul_(coef)
            self._grad_factor *= coef
        return total.to(torch.float32)

    def _counted_grads(self) -> Iterator[Tuple[torch.Tensor, float]]:
        """(gradient piece, pending factor) of what this rank counts in the model's norm: its
        whole shard, except that a tp rank other than 0 skips the parameters every tp rank
        holds whole (their copies are equal; only tp rank 0 counts them), and every rank skips
        a pipeline stage's copy of a parameter an earlier stage holds too (a tied head)."""
        for fg in self.flat_groups:
            factor = 1.0 if fg.master is None else self._grad_factor
            if all(self._counts(p) for p in fg.params):
                for b in range(len(fg.plan.buckets)):
                    yield self._shard_grad(fg, b), factor
                continue
            for seg in fg.plan.segments(fg.rank):
                if self._counts(fg.params[seg.slot]):
                    yield self._segment_grad(fg, seg), factor

    def _counts(self, p: torch.Tensor) -> bool:
        """Whether this rank's piece of ``p`` counts in the model's norm (see above)."""
        if is_tied_copy(p):
            return False
        copies = self.tp_comm is not None and self.tp_comm.rank != 0
        return not copies or is_tensor_parallel_shard(p)

    def _segment_grad(self, fg: _FlatGroup, seg: Segment) -> torch.Tensor:
        """The reduced gradient of one parameter piece of this rank's shard."""
        if fg.grad_flat is not None:
            return fg.grad_flat[seg.flat_offset : seg.flat_offset + seg.length]
        return fg.grad_shard[seg.shard_offset : seg.shard_offset + seg.length]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Steps this rank's shard and (stages 1, 2) all-gathers the parameters; skipped on
        every rank by the loss scaler when it found inf/NaN."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduced()
        for fg in self.flat_groups:
            for piece in fg.pieces:
                piece.grad = None
        fp32 = [fg for fg in self.flat_groups if fg.master is None]
        for fg in fp32:
            self._set_piece_grads(fg)
        if fp32:
            self.optim.step()
            for fg in fp32:
                for piece in fg.pieces:
                    piece.grad = None
        for fg in self.flat_groups:
            if fg.master is not None:
                self._step_16bit(fg)
        for fg in fp32:
            self._set_piece_grads(fg)
        self._grad_factor = 1.0
        if self.stage != 3:
            self._all_gather_params()
        return loss

    def _step_16bit(self, fg: _FlatGroup) -> None:
        """Steps the FP32 master one bucket slice at a time (one FP32 gradient buffer of a
        slice, not of the shard), then rounds it into the 16-bit values."""
        for b, piece in enumerate(fg.pieces):
            grad = self._step_grad[: piece.numel()]
            grad.copy_(self._shard_grad(fg, b))
            if self._grad_factor != 1.0:
                grad.mul_(self._grad_factor)
            piece.grad = grad
            self.optim.step()
            piece.grad = None
            self._shard_slice(fg, b).copy_(piece)

    def _all_gather_params(self) -> None:
        """Stages 1, 2: every bucket's slices back into the full values, in place."""
        works = []
        for fg in self.flat_groups:
            for b in fg.plan.buckets:
                out = fg.flat[b.start : b.start + b.numel]
                inp = fg.flat[b.slice_start(fg.rank) : b.slice_start(fg.rank) + b.slice_numel]
                if fg.world_size > 1:
                    works.append(fg.comm.all_gather(out, inp, async_op=True))
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients: stage 1 zeroes the flat gradient buffer (``.grad`` stay its
        views), stages 2, 3 set ``.grad`` to None; the shard gradients are rewritten by the
        next reduction."""
        if self.reducer.in_pass:
            self._finish_pass()  # never leave collectives in flight
        for fg in self.flat_groups:
            if self.stage == 1:
                fg.grad_flat.zero_()
                for s, p in enumerate(fg.params):
                    p.grad = self._grad_view(fg, s)
            else:
                for p in fg.params:
                    p.grad = None
                fg.grad_shard.zero_()
        self.reducer.collective.clear()
        self._grad_factor = 1.0

    # ----------------------------------------------------------------- introspection

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Stage 3: the model's full parameters, readable inside the block (collective);
        stages 1, 2 always hold them."""
        if self._gatherer is None:
            yield
            return
        with self._gatherer.all_gathered():
            yield

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of optimizer state held by this rank, per dtype, measured from the tensors
        (the FP32 master shards of 16-bit parameters under ``"master"``)."""
        sizes: Dict[str, int] = defaultdict(int)
        for state in self.optim.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    sizes[str(value.dtype).replace("torch.", "")] += (
                        value.numel() * value.element_size()
                    )
        sizes["master"] = memory.storage_bytes(fg.master for fg in self.flat_groups)
        return dict(sizes)

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this engine holds on this rank: the gradient shards
        (stage 1: the full gradient buffer) and the staging buffers."""
        report = self.memory_report()
        return report.measured["gradients"] + memory.storage_bytes(self._wire_buffers())

    def _wire_buffers(self) -> List[torch.Tensor]:
        return self.reducer.collective.buffers()

    def memory_report(self) -> memory.MemoryReport:
        """Bytes per rank by kind, measured from the tensors this engine and its optimizer
        hold, beside the ZeRO paper's formula (see ``memory.py``). Optimizer state is
        counted once it exists (after the first step)."""
        fgs = self.flat_groups
        live_grads = [p.grad for fg in fgs for p in fg.params if p.grad is not None]
        if self.stage == 1:
            grads = [fg.grad_flat for fg in fgs] + live_grads
        else:
            grads = [fg.grad_shard for fg in fgs] + live_grads
        values = [fg.values if self.stage == 3 else fg.flat for fg in fgs]
        state = [fg.master for fg in fgs] + [
            v
            for s in self.optim.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1
        ]
        buffers = self._wire_buffers() + [self._step_grad]
        gathered = self._gatherer.peak_gathered_bytes if self._gatherer is not None else 0
        measured = {
            "parameters": memory.storage_bytes(values),
            "gradients": memory.storage_bytes(grads),
            "optimizer_state": memory.storage_bytes(state),
            "buffers": memory.storage_bytes(buffers) + gathered,
        }
        per_element = memory.state_bytes_per_element(self.optim)
        if per_element is None:  # an optimizer the formula does not know: its measured state
            shard = sum(fg.plan.shard_numel for fg in fgs)
            master = memory.storage_bytes(fg.master for fg in fgs)
            per_element = (measured["optimizer_state"] - master) // max(1, shard)
        counts = [
            memory.GroupCounts(
                sum(s.numel for s in fg.plan.slots),
                fg.plan.numel,
                fg.plan.shard_numel,
                fg.flat.element_size(),
                fg.flat.element_size(),
                4 if fg.master is not None else 0,
                per_element,
            )
            for fg in fgs
        ]
        # the formula per sharding world: expert groups are sharded over expert_comm only
        formula = {k: 0 for k in memory.KINDS}
        allowance = dict(formula)
        for size in {fg.world_size for fg in fgs}:
            mine = [c for c, fg in zip(counts, fgs) if fg.world_size == size]
            for total, part in (
                (formula, memory.formula_bytes(self.stage, size, mine)),
                (allowance, memory.padding_allowance(self.stage, size, mine)),
            ):
                for k in memory.KINDS:
                    total[k] += part[k]
        allowance["buffers"] = self.buffer_bound()
        return memory.MemoryReport(
            self.stage,
            self.world_size,
            sum(c.numel for c in counts),
            measured,
            formula,
            allowance,
            per_element,
        )

    def buffer_bound(self) -> int:
        """The communication buffers this engine allows itself, in bytes: per wire dtype
        ``STAGING_SLOTS`` buckets and as many bucket slices, one FP32 bucket slice (16-bit
        parameters), and at stage 3 the gathered full values of at most three units (the
        root, the one running and the one prefetched) plus one per level of unit nesting."""
        bucket: Dict[torch.dtype, Tuple[int, int]] = {}
        for fg in self.flat_groups:
            itemsize = torch.empty((), dtype=fg.wire_dtype).element_size()
            size = max(b.numel for b in fg.plan.buckets) * itemsize
            piece = max(b.slice_numel for b in fg.plan.buckets) * itemsize
            old = bucket.get(fg.wire_dtype, (0, 0))
            bucket[fg.wire_dtype] = (max(old[0], size), max(old[1], piece))
        bound = sum(STAGING_SLOTS * (n + s) for n, s in bucket.values())
        if self._step_grad is not None:
            bound += self._step_grad.numel() * 4
        if self._gatherer is not None:
            bound += self._gatherer.gathered_bound()
        return bound

    def describe(self) -> str:
        """The partition plan, printable."""
        return (
            f"ShardedOptimizer stage {self.stage}, rank {self.rank}/{self.world_size}\n{self.plan}"
        )

    # ----------------------------------------------------------------- shards, for checkpoints

    def shard_tensors(self, g: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict]:
        """Flat group ``g`` on this rank: FP32 master shard, element-wise optimizer state as
        shard-long FP32 vectors, and the replicated state (``step``...) of its first bucket."""
        fg = self.flat_groups[g]
        master = fg.master if fg.master is not None else torch.cat(list(fg.pieces)).float()
        elementwise: Dict[str, List[torch.Tensor]] = defaultdict(list)
        replicated: Dict[str, Any] = {}
        for b, piece in enumerate(fg.pieces):
            for key, value in self.optim.state.get(piece, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == piece.shape
                    and value.numel() > 1
                ):
                    elementwise[key].append(value.detach())
                elif b == 0:
                    replicated[key] = (
                        value.detach().clone() if isinstance(value, torch.Tensor) else value
                    )
        state = {k: torch.cat(v) for k, v in elementwise.items() if len(v) == len(fg.pieces)}
        return master.detach().cpu(), {k: v.cpu() for k, v in state.items()}, replicated

    def load_shard_tensors(self, shards: List[Tuple[torch.Tensor, Dict, Dict, Dict]]) -> None:
        """Inverse of :meth:`shard_tensors` for every flat group: ``(master, elementwise state,
        replicated state, param-group options)``; then the values follow the masters (stages
        1, 2 all-gather them). Collective."""
        local_state: Dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        for g, (_, state, replicated, options) in enumerate(shards):
            fg = self.flat_groups[g]
            ids = []
            for bucket in fg.plan.buckets:
                lo, n = bucket.shard_offset, bucket.slice_numel
                if state or replicated:
                    local_state["state"][index] = {
                        **{
                            k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in replicated.items()
                        },
                        **{k: v[lo : lo + n].clone() for k, v in state.items()},
                    }
                ids.append(index)
                index += 1
            current = {k: v for k, v in self.optim.param_groups[g].items() if k != "params"}
            local_state["param_groups"].append({**current, **options, "params": ids})
        self.load_local_state_dict(local_state)
        with torch.no_grad():
            for fg, (master, _, _, _) in zip(self.flat_groups, shards):
                if fg.master is not None:
                    fg.master.copy_(master)
                for b, bucket in enumerate(fg.plan.buckets):
                    src = master[bucket.shard_offset : bucket.shard_offset + bucket.slice_numel]
                    self._shard_slice(fg, b).copy_(src)
        self.zero_grad()
        if self.stage != 3:
            self._all_gather_params()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard state (the local optimizer's state dict) with its world size and
        rank; use :func:`dist_kernels.checkpoint.save` for checkpoints that reshard."""
        return {"world_size": self.world_size, "rank": self.rank, "local": self.optim.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict` of the same rank and world size."""
        if (state_dict.get("world_size"), state_dict.get("rank")) != (self.world_size, self.rank):
            raise ValueError(
                f"state_dict: saved by rank {state_dict.get('rank')} of "
                f"{state_dict.get('world_size')}, this is rank {self.rank} of {self.world_size}; "
                "use dist_kernels.checkpoint.load to reshard"
            )
        self.load_local_state_dict(state_dict["local"])

    def load_local_state_dict(self, local: Dict[str, Any]) -> None:
        """Loads the local optimizer's state dict of this rank's shard.

        torch's ``load_state_dict`` replaces the optimizer's ``param_groups`` and ``state``
        objects; they are re-shared here, or a learning-rate scheduler built on this optimizer
        would keep setting the rate on the old groups while the shards step with the loaded one.
        """
        self.optim.load_state_dict(local)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def close(self) -> None:
        """Removes the gradient (and stage 3 module) hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._gatherer is not None:
            self._gatherer.detach()


def _check_arguments(stage, grad_dtype, bucket_cap_mb, module, units) -> None:
    if stage not in (1, 2, 3):
        raise ValueError(f"stage: must be 1, 2 or 3, got {stage}")
    if stage == 3 and not isinstance(module, torch.nn.Module):
        raise ValueError(
            "stage 3 shards the parameters and gathers them in the model's forward hooks: "
            "pass module=<the model> (a torch.nn.Module)"
        )
    if stage != 3 and (module is not None or units is not None):
        raise ValueError(f"module / units: only stage 3 uses them, got stage {stage}")
    if grad_dtype not in (None, *_FLOAT_DTYPES):
        raise TypeError(f"grad_dtype: must be None, float32, float16 or bfloat16, got {grad_dtype}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb: must be > 0, got {bucket_cap_mb}")


def _param_groups(params: Iterable[Any]) -> List[Dict[str, Any]]:
    """Normalises ``params`` to a list of groups and checks them."""
    params = list(params)
    if not params:
        raise ValueError("params: got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    seen = set()
    for gi, group in enumerate(groups):
        group = dict(group)
        plist = group["params"]
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        for p in plist:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params: group {gi} holds a {type(p).__name__}, not a tensor")
        # frozen parameters get no gradient and must not be decayed: they are not sharded
        group["params"] = [p for p in plist if p.requires_grad]
        groups[gi] = group
        for p in group["params"]:
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"params: unsupported dtype {p.dtype} (float32/16, bfloat16)")
            if id(p) in seen:
                raise ValueError("params: a parameter appears twice")
            seen.add(id(p))
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("params: no parameter requires grad")
    devices = {p.device for g in groups for p in g["params"]}
    if len(devices) != 1:
        raise ValueError(
            f"params: all parameters must be on one device, got {sorted(map(str, devices))}"
        )
    return groups


def _group_options(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _refuse_experts(p: torch.Tensor, comm: Any) -> None:
    """Raises for a sharded MoE expert's parameter: not reducible over one communicator."""
    if getattr(p, "expert_parallel", False):
        raise NotImplementedError(
            f"[rank {comm.rank}] ShardedOptimizer: params hold expert-parallel parameters "
            "(dk.moe experts sharded over ep); sharded over comm alone they would be "
            "averaged with other ranks' different experts: pass "
            "expert_comm=mesh.expert_dp_comm (with comm=mesh.dp_comm)"
        )


def _check_expert_comm(comm: Any, expert_comm: Any) -> None:
    """``expert_comm`` must be a subgroup of ``comm`` (the replicas of one expert shard)."""
    if expert_comm is None:
        return
    if comm.world_size % expert_comm.world_size:
        raise ValueError(
            f"[rank {comm.rank}] ShardedOptimizer: expert_comm's world size "
            f"({expert_comm.world_size}) does not divide comm's ({comm.world_size}): it must be "
            "the replicas of this rank's experts, a subgroup of comm (mesh.expert_dp_comm with "
            "comm=mesh.dp_comm)"
        )


def _refuse_ddp(p: torch.Tensor) -> None:
    """Raises if ``p`` belongs to a :class:`dist_kernels.DistributedDataParallel`."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    for hook in hooks.values():
        if "DistributedDataParallel." in getattr(hook, "__qualname__", ""):
            raise ValueError(
                "params: these parameters belong to a dist_kernels.DistributedDataParallel. "
                "ShardedOptimizer reduces (reduce-scatters) the gradients itself through its "
                "own hooks, so DDP would reduce them a second time and hold full gradient "
                "buckets: pass the plain module's parameters (model.module.parameters()) "
                "and drop the DDP wrapper."
            )
