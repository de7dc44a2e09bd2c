"""DistributedDataParallel: bucketed gradient all-reduce overlapped with backward.

Drop-in for ``torch.nn.parallel.DistributedDataParallel`` where the options mean the same::

    model = dk.DDP(module, bucket_cap_mb=25, grad_dtype=torch.bfloat16)
    loss = model(x).sum(); loss.backward()        # .grad now holds the mean over ranks
    with model.no_sync(): model(x2).sum().backward()   # accumulate locally

The engine is three parts it holds, each with its own state (docs/ddp.md walks one backward):

* ``self.reducer``: a :class:`dist_kernels.buckets.reducer.BucketReducer`, the owner of the
  gradient buckets: the plan, their registered memory and ``.grad`` views (through its
  collective, ``buckets.all_reduce.AllReduce``, or ``buckets.comm_hook.CommHook`` after
  :meth:`register_comm_hook`, or ``InPlace`` on one rank), one backward's readiness, the launch
  order, waiting, unpacking and the re-plan after the first backward;
* ``self._backward``: a :class:`dist_kernels.ddp.backward.BackwardSync`, the autograd side:
  arming, the gradient hooks and their firing counts (static graph), the pass start and the
  end-of-backward callback, unused parameters, errors on every rank, the loss scaler hand-off;
* ``self._uneven``: a :class:`dist_kernels.ddp.join.UnevenInputs`, the buffer broadcast before
  forwards and what a rank that ran out of batches does under :meth:`join`.

This module is the engine itself: construction, the forward and the arming of the next backward,
torch's attributes and methods. ``ddp/options.py`` checks the constructor's arguments and picks
the Communicator, ``ddp/structure.py`` compares the model across ranks, ``ddp/broadcast.py``
copies rank 0's parameters and buffers to every rank.

Whether a backward synchronises is decided before it starts: by its forward (with
``require_backward_grad_sync`` True, i.e. not inside ``no_sync()``), or by
:meth:`DistributedDataParallel.set_requires_gradient_sync`, whichever ran last; while that
switch is off, forwards do not arm at all.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable

from ..buckets import plan
from ..buckets.all_reduce import AllReduce, GradientBuckets, InPlace
from ..buckets.comm_hook import CommHook, hook_name
from ..buckets.plan import plan_buckets
from ..buckets.reducer import BucketReducer
from ..buckets.reductions import Reductions
from .backward import BackwardSync
from .broadcast import broadcast_state
from .join import DDPJoinHook, UnevenInputs
from .options import _check_options, _resolve_comm
from .structure import check_structure

__all__ = ["DistributedDataParallel", "DDP"]

_MB = 1024 * 1024


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
        expert_comm: not torch's: the Communicator over which parameters marked
            ``expert_parallel`` (``dk.moe`` experts) are reduced: their replicas, a subgroup
            of ``comm`` (``mesh.expert_dp_comm``, with ``comm`` = ``mesh.dp_comm``). Their
            buckets are summed there and divided by ``comm``'s world size (each expert's
            gradient already sums its ep group's tokens); ``init_sync`` broadcasts them from
            that group's rank 0. None: every parameter over ``comm``.
    """

    def __init__(
        self, module: nn.Module, comm: Any = None, *, bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1, grad_dtype: Optional[torch.dtype] = None,
        algorithm: str = "auto", gradient_predivide_factor: Optional[float] = None,
        find_unused_parameters: bool = False, broadcast_buffers: bool = True,
        loss_scaler: Any = None, process_group: Any = None,
        device_ids: Optional[Sequence[Any]] = None, output_device: Any = None, dim: int = 0,
        gradient_as_bucket_view: bool = True, static_graph: bool = False, init_sync: bool = True,
        expert_comm: Any = None,
    ) -> None:  # fmt: skip
        super().__init__()
        Joinable.__init__(self)
        _check_options(module, bucket_cap_mb, first_bucket_mb, grad_dtype,
                       gradient_predivide_factor, device_ids, output_device, dim)  # fmt: skip
        self.module, self.dim, self.output_device = module, dim, output_device
        self.device_ids = None if device_ids is None else list(device_ids)
        self.comm, self._owns_comm = _resolve_comm(module, comm, process_group)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.grad_dtype, self.algorithm = grad_dtype, algorithm
        self._predivide, self._comm_hook = gradient_predivide_factor, None
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_bytes_cap = int(bucket_cap_mb * _MB)
        #: torch DDP's: forwards arm their backward to synchronise (False in :meth:`no_sync`).
        self.require_backward_grad_sync, self._sync_switch = True, True  # switch: FSDP2's
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        check_structure(self.comm, module, [p for _, p in named])
        self.expert_comm = expert_comm
        _check_experts(module, expert_comm, self.comm.rank)
        experts = [p for p in module.parameters() if _is_expert(p, expert_comm)]
        if init_sync:
            dense = [p for p in module.parameters() if not _is_expert(p, expert_comm)]
            broadcast_state(self.comm, dense + list(module.buffers()))
            if experts:
                broadcast_state(expert_comm, experts)
        self.reducer = _make_reducer(
            self.comm, named, bucket_cap_mb, first_bucket_mb, grad_dtype, algorithm,
            gradient_predivide_factor, gradient_as_bucket_view, expert_comm,
        )  # fmt: skip
        self._backward = BackwardSync(
            self.reducer, named, self.comm, find_unused_parameters, static_graph, loss_scaler
        )
        self._uneven = UnevenInputs(
            self.comm, module, self.reducer, self._backward, broadcast_buffers
        )

    # ----------------------------------------------------------------- torch's attributes

    @property
    def find_unused_parameters(self) -> bool:
        """torch's attribute: parameters may go without a gradient (settable, as in torch)."""
        return self._backward.find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        self._backward.find_unused_parameters = value

    @property
    def broadcast_buffers(self) -> bool:
        """torch's attribute: forwards broadcast the buffers first (settable, as in torch)."""
        return self._uneven.broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._uneven.broadcast_buffers = value

    @property
    def loss_scaler(self) -> Any:
        """The LossScaler the end of backward unscales for (None: none)."""
        return self._backward.loss_scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler: Any) -> None:
        self._backward.loss_scaler = scaler

    @property
    def static_graph(self) -> bool:
        """torch's attribute: True when constructed so or after :meth:`_set_static_graph`."""
        return self._backward.static_graph

    @property
    def found_inf(self) -> bool:
        """Whether the last synchronised backward had an inf/NaN gradient on any rank."""
        return self._backward.found_inf

    @property
    def bucket_plan(self) -> Optional[plan.BucketPlan]:
        """The bucket plan (printable), in launch order; None on one rank."""
        return self.reducer.plan if self.world_size > 1 else None

    @property
    def process_group(self) -> Any:
        """The torch process group of the Communicator (torch's attribute)."""
        return getattr(self.comm, "group", None)

    def will_sync_module_buffers(self) -> bool:
        """Whether forwards broadcast the module's buffers (torch's method)."""
        return self.broadcast_buffers and bool(self._uneven.buffers) and self.world_size > 1

    # ----------------------------------------------------------------- the buckets

    @property
    def bytes_all_reduced(self) -> int:
        """Payload bytes this rank has handed to all-reduces in backward passes (read-only).

        Buckets (or what a comm hook sends instead), status slots and used masks; not the
        construction-time broadcasts. A ring all-reduce moves ``2 (n - 1) / n`` times this per
        rank. The difference over one step is that step's cost on the wire.
        """
        return self.reducer.collective.bytes_sent

    @property
    def reductions_launched(self) -> int:
        """Bucket all-reduces launched since construction (read-only).

        A synchronised backward launches ``len(bucket_layouts)`` of them (the small used-mask
        all-reduce of ``find_unused_parameters`` is not counted); a backward that does not
        synchronise launches none. Always 0 on one rank, where nothing is reduced.
        """
        return self.reducer.launched

    @property
    def buckets(self) -> List[torch.Tensor]:
        """The registered bucket tensors, in launch order (the last carries the status slots)."""
        return list(self.reducer.collective.tensors)

    @property
    def bucket_layouts(self) -> List[plan.Bucket]:
        """The current bucket plan, in launch order, as allocated (status slots included)."""
        return list(self.reducer.buckets)

    def describe_buckets(self) -> str:
        """The bucket plan, one bucket a line, with parameter names."""
        return "\n".join(
            f"{b.describe()}: {', '.join(s.name for s in b.slots)}" for b in self.reducer.buckets
        )

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
        self._backward.abandon_if_stale()
        route = self.reducer.collective
        what = f"[rank {self.rank}] DistributedDataParallel.register_comm_hook"
        if self._comm_hook is not None:
            raise RuntimeError(
                f"{what}: a hook ({hook_name(self._comm_hook)}) is already registered; "
                "register once"
            )
        if not callable(hook):
            raise TypeError(
                f"{what}: hook must be callable as hook(state, bucket), got {type(hook).__name__}"
            )
        if self._backward.in_pass:
            raise RuntimeError(
                f"{what}: called during a synchronised backward; register before the first backward"
            )
        if self.grad_dtype is not None or self._predivide is not None:
            raise ValueError(
                f"{what}: the hook decides the wire dtype and the division; construct without "
                f"grad_dtype (got {self.grad_dtype}) and gradient_predivide_factor"
            )
        self._comm_hook = hook
        if isinstance(route, AllReduce):  # on one rank nothing is reduced: no hook runs
            self.reducer.set_collective(CommHook.replacing(route, hook, state))

    def close(self) -> None:
        """Removes the gradient hooks; closes the Communicator if this engine created it.

        ``.grad`` tensors that are bucket views are copied out first, so they stay valid.
        """
        self._backward.close()
        self.reducer.collective.detach_views()
        if self._owns_comm and hasattr(self.comm, "close"):
            self.comm.close()

    # ----------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module. With gradients enabled it also decides whether the next backward
        synchronises: yes, unless inside :meth:`no_sync` or with the gradient sync switch off
        (a forward under ``torch.no_grad()`` leaves the decision as it was)."""
        self._backward.abandon_if_stale()
        join_work = Join.notify_join_context(self)  # None unless under join()
        deciding = torch.is_grad_enabled()
        if deciding:
            self._backward.armed = self.require_backward_grad_sync and self._sync_switch
        under_join = self._join_config.enable
        self._uneven.sync_buffers(active=True, under_join=under_join)
        if under_join:
            # Tell joined ranks whether a synchronised backward follows (they shadow it).
            self._uneven.flag(deciding and self._backward.armed)
            divide_by_all = self._uneven.divide_by_initial_world_size
            self._backward.join_work = None if divide_by_all else join_work
        output = self.module(*args, **kwargs)
        if deciding:
            self._backward.prepare(output)
        return output

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
        self._backward.set_static_graph()

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
        self._backward.abandon_if_stale()
        if self._backward.in_pass:
            raise RuntimeError(
                f"[rank {self.rank}] DistributedDataParallel.set_requires_gradient_sync: called "
                "during a synchronised backward; call it before the backward it should affect"
            )
        self._sync_switch = requires_gradient_sync
        self._backward.arm(requires_gradient_sync)

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
        return DDPJoinHook(self._uneven, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._uneven.device

    @property
    def join_process_group(self) -> Any:
        """The torch process group of the Communicator (Join counts active ranks on it)."""
        return getattr(self.comm, "group", None)


DDP = DistributedDataParallel


def _make_reducer(
    comm: Any,
    named: Sequence[Tuple[str, torch.Tensor]],
    bucket_cap_mb: float,
    first_bucket_mb: float,
    grad_dtype: Optional[torch.dtype],
    algorithm: str,
    predivide: Optional[float],
    gradient_as_bucket_view: bool,
    expert_comm: Any = None,
) -> BucketReducer:
    """The bucket reducer of one engine: on one rank nothing to reduce (``InPlace``), else
    registered buckets all-reduced in reverse registration order first, re-planned in the
    observed order after the first backward (collective: allocates the buckets)."""
    params = [p for _, p in named]
    cap_bytes, first_bucket_bytes = int(bucket_cap_mb * _MB), int(first_bucket_mb * _MB)
    device = torch.device(getattr(comm, "device", "cpu"))
    if comm.world_size == 1:
        return BucketReducer(InPlace(params, device), [], len(params), comm=comm)
    # Gradients are multiplied by 1 / factor on their way into the bucket (fused with the
    # copy or cast, so FP16 partial sums stay in range), summed, and by factor / world_size
    # on the way out. When that is 1 and the wire dtype is the parameters' own (FP32 or
    # BF16), contiguous parameters' .grad become views of the registered buckets and nothing
    # is copied out; the inverse loss scale then joins the pre-scale too.
    post_scale = float(predivide or comm.world_size) / comm.world_size
    views = (
        gradient_as_bucket_view
        and post_scale == 1.0
        and all(grad_dtype in (None, p.dtype) and p.dtype != torch.float16 for p in params)
    )
    memory = GradientBuckets(comm, params, views)
    debug = os.environ.get("DK_DEBUG", "0") not in ("", "0")
    route = AllReduce(
        memory, Reductions(comm, algorithm), predivide=predivide, debug=debug, rank=comm.rank
    )

    def group_of(i: int) -> int:  # 1: an expert's bucket, reduced over expert_comm
        return int(_is_expert(params[i], expert_comm))

    def planner(order: Sequence[int]) -> plan.BucketPlan:
        return plan_buckets(
            list(named), cap_bytes, grad_dtype, first_bucket_bytes, order=list(order),
            group_of=group_of,
        )  # fmt: skip

    initial = planner(list(reversed(range(len(params)))))
    groups = {1: expert_comm} if expert_comm is not None else None
    return BucketReducer(
        route, initial, len(params), comm=comm, planner=planner, group_comms=groups
    )


def _check_experts(module: nn.Module, expert_comm: Any, rank: int) -> None:
    if expert_comm is None and any(
        getattr(p, "expert_parallel", False) for p in module.parameters()
    ):
        raise ValueError(
            f"[rank {rank}] DistributedDataParallel: the module has expert-parallel parameters "
            "(dk.moe experts sharded over ep): pass expert_comm=mesh.expert_dp_comm, or they "
            "would be averaged with other ranks' different experts"
        )


def _is_expert(p: torch.Tensor, expert_comm: Any) -> bool:
    """A parameter reduced over ``expert_comm`` (an MoE expert's, when one is given)."""
    return expert_comm is not None and getattr(p, "expert_parallel", False)
