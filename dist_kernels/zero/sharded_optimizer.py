"""ShardedOptimizer: ZeRO stages 1 and 2 on a dist_kernels Communicator.

    opt = dk.ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Every parameter lives in a flat buffer (one per param group and dtype, registered with
``comm.empty``) laid out by the pure plan of ``partition.py``: buckets split into equal, aligned
per-rank slices. Rank ``r`` owns slice ``r`` of every bucket; the concatenation of its slices is
its *shard*: the only parameters its optimizer steps and the only optimizer state it holds (an FP32
master copy for 16-bit parameters). How one iteration runs:

1. Backward. A post-accumulate-grad hook of ours marks each parameter ready (no DDP wrapper
   needed). Buckets are reduce-scattered in plan order (the same order on every rank) as soon as
   all their gradients are in, asynchronously, so communication overlaps the rest of backward.
   *Stage 1* keeps the full gradients (``.grad`` are views of one flat gradient buffer) and
   reduce-scatters buckets of it. *Stage 2* copies each gradient into one of two bucket-sized
   staging buffers (cast to ``grad_dtype`` on the way) and frees ``.grad`` at once: no full
   gradient buffer exists, only the FP32 gradient shard. A callback at the end of backward
   launches what is left and waits.
2. ``step()``: the local optimizer steps the shard, then every bucket is all-gathered back
   into the flat parameter buffer, which the model's parameters view.

Loss scaling: ``dk.LossScaler(comm=opt.comm)`` used as ``torch.amp.GradScaler`` is
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``) unscales the FP32 shard
gradients (``opt.param_groups`` holds the shards) and all-reduces its found-inf flag, so an
overflow on any rank's shard skips the step on every rank. Without ``comm`` the ranks would
disagree and the next collective would hang.

Reduce-scatters average (``ReduceOp.AVG``) with FP32 accumulation inside the collective; a 16-bit
``grad_dtype`` halves the bytes on the wire.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Type

import torch

from ..dtypes import ReduceOp
from .partition import FlatGroupPlan, ParamSpec, PartitionPlan, plan_partition

__all__ = ["ShardedOptimizer"]

_MB = 1024 * 1024
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STAGING_SLOTS = 2  # stage 2: one bucket filling while the previous one is on the wire


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
    dtype: torch.dtype  # parameter dtype
    wire_dtype: torch.dtype  # reduce-scatter dtype
    flat: torch.Tensor  # every parameter's values (registered); parameters view it
    shard: torch.nn.Parameter  # this rank's slices, in the optimizer's dtype (FP32 master)
    send: torch.Tensor  # shard in the parameter dtype: the all-gather input
    grad_flat: Optional[torch.Tensor] = None  # stage 1: the full gradient buffer (registered)
    staging: List[torch.Tensor] = field(default_factory=list)  # bucket-sized wire buffers
    rs_out: Optional[torch.Tensor] = None  # shard-sized wire buffer for reduce-scatter output


@dataclass
class _Piece:
    """The part of one parameter that falls in one bucket."""

    group: int
    slot: int
    bucket: int  # global bucket index
    param_lo: int  # element range within the parameter
    param_hi: int
    bucket_lo: int  # element offset within the bucket


@dataclass
class _Pass:
    """Bookkeeping of one synchronised backward."""

    pending: List[int]  # pieces still to deliver, per global bucket
    left: Dict[Tuple[int, int], int]  # pieces still to deliver, per parameter
    delivered: set = field(default_factory=set)  # (group, slot, bucket)
    deferred: List[_Piece] = field(default_factory=list)
    next_launch: int = 0
    works: List[Tuple[int, Any, Callable[[], None]]] = field(default_factory=list)  # in flight
    slot_owner: Dict[Tuple[int, int], Tuple[int, Any]] = field(default_factory=dict)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 / 2 optimizer: state, master weights and (stage 2) gradients sharded.

    Args:
        params: the model's parameters or parameter groups (as for any torch optimizer); the
            same model on every rank. Their storage moves into flat buffers.
        optimizer_class: any ``torch.optim`` optimizer, run on this rank's shard;
            :class:`dist_kernels.optim.FusedAdamW` is the fast path (one kernel per buffer).
        comm: a :class:`dist_kernels.Communicator`; default: the one ``dk.init()`` made, else a
            new one over torch.distributed's default group.
        stage: 1 (optimizer state sharded, full gradients kept) or 2 (gradients sharded too).
        grad_dtype: reduce-scatter dtype (``torch.bfloat16`` / ``torch.float16`` halve the wire
            bytes; accumulation stays FP32); None keeps each parameter's dtype.
        bucket_cap_mb: bucket size in MiB: the unit of one reduce-scatter and all-gather.
        overlap: launch reduce-scatters during backward (True) or all at the end of it.
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
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage: must be 1 or 2, got {stage}")
        if grad_dtype not in (None, *_FLOAT_DTYPES):
            raise TypeError(
                f"grad_dtype: must be None, float32, float16 or bfloat16, got {grad_dtype}"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb: must be > 0, got {bucket_cap_mb}")
        self.comm = comm if comm is not None else _default_comm()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.stage, self.grad_dtype, self.overlap = stage, grad_dtype, overlap
        groups = _param_groups(params)
        for p in (p for g in groups for p in g["params"]):
            _refuse_ddp(p)
        self.plan, self.flat_groups = self._build_flat_groups(groups, int(bucket_cap_mb * _MB))
        self._buckets = [
            (g, b) for g, fg in enumerate(self.flat_groups) for b in range(len(fg.plan.buckets))
        ]
        self._bucket_base = _bucket_bases(self.flat_groups)
        self._pieces = self._param_pieces()
        local_groups = [
            {**_group_options(groups[gi]), "params": [fg.shard]}
            for gi, fg in zip(self._group_of, self.flat_groups)
        ]
        self.optim = optimizer_class(local_groups, **optimizer_kwargs)
        super().__init__([fg.shard for fg in self.flat_groups], self.optim.defaults)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._sync = True
        self._pass: Optional[_Pass] = None
        self._callback_queued = False
        self._shard_grads_valid = False
        for p in self._all_params():
            p._dk_sharded_optimizer = True  # lets dk.DistributedDataParallel refuse these params
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(g, s))
            for g, fg in enumerate(self.flat_groups)
            for s, p in enumerate(fg.params)
        ]

    # ----------------------------------------------------------------- construction

    def _build_flat_groups(
        self, groups: List[Dict[str, Any]], bucket_cap_bytes: int
    ) -> Tuple[PartitionPlan, List[_FlatGroup]]:
        """Plans and allocates the flat buffers (collective: every rank, same order)."""
        specs, members, self._group_of = [], [], []
        for gi, group in enumerate(groups):
            by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = defaultdict(list)
            for p in group["params"]:
                by_dtype[p.dtype].append(p)
            for dtype, plist in by_dtype.items():
                # reverse registration order: the last layers' gradients arrive first
                plist = list(reversed(plist))
                key = f"{gi}/{str(dtype).replace('torch.', '')}"
                spec = [
                    ParamSpec(f"{key}/{i}", tuple(p.shape), p.numel()) for i, p in enumerate(plist)
                ]
                specs.append((key, plist[0].element_size(), spec))
                members.append((dtype, plist))
                self._group_of.append(gi)
        plan = plan_partition(specs, self.world_size, bucket_cap_bytes)
        flat_groups = [
            self._allocate(gplan, dtype, plist)
            for gplan, (dtype, plist) in zip(plan.groups, members)
        ]
        return plan, flat_groups

    def _allocate(
        self, plan: FlatGroupPlan, dtype: torch.dtype, params: List[torch.nn.Parameter]
    ) -> _FlatGroup:
        flat = self.comm.empty((plan.numel,), dtype)
        flat.zero_()
        with torch.no_grad():
            for slot, p in zip(plan.slots, params):
                flat[slot.offset : slot.offset + slot.numel].copy_(p.reshape(-1))
            if self.world_size > 1:
                self.comm.broadcast(flat, 0)  # every rank starts from rank 0's values
            for slot, p in zip(plan.slots, params):
                p.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        master_dtype = torch.float32
        shard = torch.nn.Parameter(self._gather_shard(plan, flat).to(master_dtype))
        send = shard.data if dtype == master_dtype else self.comm.empty((plan.shard_numel,), dtype)
        wire = self.grad_dtype or dtype
        fg = _FlatGroup(plan, params, dtype, wire, flat, shard, send)
        shard.grad = torch.zeros_like(shard)
        if self.stage == 1:
            fg.grad_flat = self.comm.empty((plan.numel,), dtype)
            fg.grad_flat.zero_()
            for slot, p in zip(plan.slots, params):
                p.grad = self._grad_view(fg, slot.index)
        needs_staging = self.stage == 2 or wire != dtype
        if needs_staging:
            biggest = max(b.numel for b in plan.buckets)
            fg.staging = [self.comm.empty((biggest,), wire) for _ in range(_STAGING_SLOTS)]
        if wire != master_dtype:
            fg.rs_out = self.comm.empty((plan.shard_numel,), wire)
        return fg

    def _gather_shard(self, plan: FlatGroupPlan, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slices of ``flat``, concatenated."""
        return torch.cat(
            [
                flat[b.slice_start(self.rank) : b.slice_start(self.rank) + b.slice_numel]
                for b in plan.buckets
            ]
        )

    def _param_pieces(self) -> Dict[Tuple[int, int], List[_Piece]]:
        pieces: Dict[Tuple[int, int], List[_Piece]] = defaultdict(list)
        for g, fg in enumerate(self.flat_groups):
            for b in fg.plan.buckets:
                for s in b.slots:
                    slot = fg.plan.slots[s]
                    lo = max(b.start, slot.offset)
                    hi = min(b.start + b.numel, slot.offset + slot.numel)
                    pieces[(g, s)].append(
                        _Piece(
                            g,
                            s,
                            self._bucket_base[g] + b.index,
                            lo - slot.offset,
                            hi - slot.offset,
                            lo - b.start,
                        )
                    )
        return pieces

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

    def _make_hook(self, g: int, s: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._sync:
                return
            if self._pass is None:
                _refuse_ddp(param)  # a DDP wrapped after us would reduce a second time
            state = self._begin_pass()
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if self.overlap:
                for piece in self._pieces[(g, s)]:
                    self._deliver(state, piece)
                self._launch_ready(state)

        return hook

    def _begin_pass(self) -> _Pass:
        if self._pass is None:
            pending = [0] * len(self._buckets)
            for plist in self._pieces.values():
                for piece in plist:
                    pending[piece.bucket] += 1
            left = {key: len(plist) for key, plist in self._pieces.items()}
            self._pass = _Pass(pending, left)
        return self._pass

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._finish_pass()

    def _acquire_staging(self, state: _Pass, bucket: int) -> Optional[torch.Tensor]:
        """The staging buffer of ``bucket``, zeroed when first taken; None while the window of
        ``_STAGING_SLOTS`` buckets after the next launch does not reach it yet."""
        if bucket >= state.next_launch + _STAGING_SLOTS:
            return None
        g, b = self._buckets[bucket]
        fg = self.flat_groups[g]
        key = (g, b % _STAGING_SLOTS)
        owner = state.slot_owner.get(key)
        if owner is None or owner[0] != bucket:
            if owner is not None:
                self._wait_bucket(state, owner[0])  # launched earlier: its bytes are on the wire
            buf = fg.staging[b % _STAGING_SLOTS][: fg.plan.buckets[b].numel]
            buf.zero_()
            state.slot_owner[key] = (bucket, buf)
        return state.slot_owner[key][1]

    def _deliver(self, state: _Pass, piece: _Piece) -> None:
        """Hands one piece of a gradient to its bucket (stage 2: copies it into staging)."""
        key = (piece.group, piece.slot, piece.bucket)
        if key in state.delivered:
            return
        fg = self.flat_groups[piece.group]
        p = fg.params[piece.slot]
        if self.stage == 1:
            self._adopt_grad(fg, piece.slot)
        else:
            staging = self._acquire_staging(state, piece.bucket)
            if staging is None:
                state.deferred.append(piece)
                return
            if p.grad is not None:
                n = piece.param_hi - piece.param_lo
                src = p.grad.reshape(-1)[piece.param_lo : piece.param_hi]
                staging[piece.bucket_lo : piece.bucket_lo + n].copy_(src)
        state.delivered.add(key)
        state.pending[piece.bucket] -= 1
        state.left[(piece.group, piece.slot)] -= 1
        if self.stage == 2 and state.left[(piece.group, piece.slot)] == 0:
            p.grad = None  # the gradient lives on only in the bucket

    def _adopt_grad(self, fg: _FlatGroup, s: int) -> None:
        """Stage 1: makes ``.grad`` the view of the flat gradient buffer again (a user's
        ``zero_grad(set_to_none=True)`` on the model makes autograd allocate a fresh one)."""
        p, view = fg.params[s], self._grad_view(fg, s)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _launch_ready(self, state: _Pass) -> None:
        while state.next_launch < len(self._buckets) and state.pending[state.next_launch] == 0:
            self._launch(state, state.next_launch)
            state.next_launch += 1
            deferred, state.deferred = state.deferred, []
            for piece in deferred:
                self._deliver(state, piece)

    def _launch(self, state: _Pass, bucket: int) -> None:
        """Starts the reduce-scatter of one bucket into this rank's gradient shard."""
        g, b = self._buckets[bucket]
        fg = self.flat_groups[g]
        bplan = fg.plan.buckets[b]
        if self.stage == 1:
            src = fg.grad_flat[bplan.start : bplan.start + bplan.numel]
            if fg.wire_dtype != fg.dtype:
                staging = self._acquire_staging(state, bucket)
                staging.copy_(src)
                src = staging
        else:
            src = self._acquire_staging(state, bucket)
        shard_grad = fg.shard.grad[bplan.shard_offset : bplan.shard_offset + bplan.slice_numel]
        accumulate = self.stage == 2 and self._shard_grads_valid
        direct = fg.rs_out is None and not accumulate
        if direct:
            out = shard_grad
        elif fg.rs_out is not None:
            out = fg.rs_out[bplan.shard_offset :][: bplan.slice_numel]
        else:  # accumulating an FP32 wire: a temporary the size of one slice
            out = torch.empty_like(shard_grad)
        work = self.comm.reduce_scatter(out, src, op=ReduceOp.AVG, async_op=True)

        def finish() -> None:
            if direct:
                return
            if accumulate:
                shard_grad.add_(out)
            else:
                shard_grad.copy_(out)

        state.works.append((bucket, work, finish))

    def _wait_bucket(self, state: _Pass, bucket: int) -> None:
        for i, (b, work, finish) in enumerate(state.works):
            if b == bucket:
                work.wait()
                finish()
                del state.works[i]
                return

    def _finish_pass(self) -> None:
        """Delivers what backward left (unused parameters count as zero gradients), launches
        the remaining buckets in order and waits for every reduce-scatter."""
        state = self._begin_pass()
        for piece_list in self._pieces.values():
            for piece in piece_list:
                if (piece.group, piece.slot, piece.bucket) not in state.delivered:
                    state.deferred.append(piece)
        state.deferred.sort(key=lambda pc: pc.bucket)
        while state.next_launch < len(self._buckets):
            deferred, state.deferred = state.deferred, []
            for piece in deferred:
                self._deliver(state, piece)
            self._launch_ready(state)
        for _bucket, work, finish in state.works:
            work.wait()
            finish()
        self._pass = None
        self._shard_grads_valid = True

    # ----------------------------------------------------------------- step

    def _reduced(self) -> None:
        """Makes sure the shard gradients hold this iteration's reduced gradients."""
        if self._pass is not None or not self._shard_grads_valid:
            self._finish_pass()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the gradients so that their global norm is at most ``max_norm``; returns the
        norm before clipping. Each rank sums over its shard (every element owned once)."""
        self._reduced()
        norm_type = float(norm_type)
        grads = [fg.shard.grad for fg in self.flat_groups]
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max().reshape(1)
            op = ReduceOp.MAX
        else:
            local = sum(g.double().abs().pow(norm_type).sum() for g in grads).reshape(1)
            local = local.to(torch.float64)
            op = ReduceOp.SUM
        if self.world_size > 1:
            self.comm.all_reduce(local, op=op)
        total = local[0] if math.isinf(norm_type) else local[0] ** (1.0 / norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total.to(torch.float32)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Steps this rank's shard and all-gathers the parameters (skipped on every rank when
        the loss scaler found inf/NaN)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduced()
        self.optim.step()
        self._all_gather_params()
        return loss

    def _all_gather_params(self) -> None:
        works = []
        for fg in self.flat_groups:
            if fg.send is not fg.shard.data:
                fg.send.copy_(fg.shard)
            for b in fg.plan.buckets:
                out = fg.flat[b.start : b.start + b.numel]
                inp = fg.send[b.shard_offset : b.shard_offset + b.slice_numel]
                if self.world_size == 1:
                    out.copy_(inp)
                else:
                    works.append(self.comm.all_gather(out, inp, async_op=True))
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients: stage 1 zeroes the flat gradient buffer (``.grad`` stay its
        views), stage 2 sets ``.grad`` to None; the shard gradients are rewritten by the next
        reduction."""
        if self._pass is not None:
            self._finish_pass()  # never leave collectives in flight
        for fg in self.flat_groups:
            if self.stage == 1:
                fg.grad_flat.zero_()
                for s, p in enumerate(fg.params):
                    p.grad = self._grad_view(fg, s)
            else:
                for p in fg.params:
                    p.grad = None
            fg.shard.grad.zero_()
        self._shard_grads_valid = False

    # ----------------------------------------------------------------- introspection

    def state_bytes(self) -> Dict[str, int]:
        """Bytes of optimizer state held by this rank, per dtype, measured from the tensors
        (the shard master weights included under ``"master"``)."""
        sizes: Dict[str, int] = defaultdict(int)
        for state in self.optim.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    sizes[str(value.dtype).replace("torch.", "")] += (
                        value.numel() * value.element_size()
                    )
        sizes["master"] = sum(fg.shard.numel() * fg.shard.element_size() for fg in self.flat_groups)
        return dict(sizes)

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this engine holds on this rank: the shard gradients, the
        staging buckets and (stage 1) the full gradient buffer."""
        total = 0
        for fg in self.flat_groups:
            tensors = [fg.shard.grad, *fg.staging]
            if fg.grad_flat is not None:
                tensors.append(fg.grad_flat)
            if fg.rs_out is not None:
                tensors.append(fg.rs_out)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def describe(self) -> str:
        """The partition plan, printable."""
        return (
            f"ShardedOptimizer stage {self.stage}, rank {self.rank}/{self.world_size}\n{self.plan}"
        )

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
        """Removes the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


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


def _bucket_bases(flat_groups: List[_FlatGroup]) -> List[int]:
    bases, total = [], 0
    for fg in flat_groups:
        bases.append(total)
        total += len(fg.plan.buckets)
    return bases


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
