"""Pipeline parallelism: ``dk.Pipeline`` runs one rank's list of a schedule planned as data.

Schedules (``pipeline/schedules.py``) are per-rank action lists, checked on a fake runtime
(``pipeline/checker.py``) before anything runs; :func:`schedule_table` draws them::

    >>> print(dk.pipeline.schedule_table("zb-h1", 2, 3))
    zb-h1: 2 ranks, 2 stages, 3 micro-batches; step 10, bubble 10.0% (rate 0.11), ...
    rank 0 | F0 F1 .  I0 W0 F2 I1 W1 I2 W2
    rank 1 | .  F0 I0 F1 I1 W0 F2 I2 W1 W2

The engine keeps only its rank's stages (``pipeline/partition.py`` splits an ``nn.Sequential``).
A training step splits the batch into micro-batches and runs the rank's list in order on the
caller's thread: forward and backward of its stages (a full B, or its I and W halves,
``pipeline/split.py``), and each send, started with the Communicator's ``isend`` as soon as
its tensor exists (``pipeline/wire.py``). Receives run on the same thread, each peer's in list
order, when a step needs their tensor: the message waits in the peer's shared-memory FIFO until
then, and the waiting thread is the one that computes next (no hand-over between threads, no
GIL contention).
The last stage averages the micro-batch losses, so the accumulated gradients equal those of the
whole batch; the loss is then broadcast to every rank of the pipeline.

Failure: the action that raised is named (rank, stage, action, micro-batch) and the
communicator is closed, so peers blocked on this rank raise ``CommError`` within their timeout
and close theirs in turn: every rank raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .actions import Action, Kind
from .checker import check_schedule, receives_by_peer, runtime_order
from .partition import build_stage, format_partition, plan_partition
from .profiling import ActionTimer, gather_times, measure_p2p
from .schedules import build_schedule
from .split import WeightGradient, backward_input, parameter_nodes
from .split_linear import (
    LinearWeightGradient,
    Recorder,
    Recording,
    backward_input_linear,
    linear_modules,
    supports,
)
from .tied import exchange_grads, share_values, untie
from .wire import ACTIVATION, GRADIENT, Channels

__all__ = ["Pipeline", "PipelineError"]

TensorOrTuple = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


class PipelineError(RuntimeError):
    """A stage failed; the message names the rank, stage, action and micro-batch."""


class _SoloComm:
    """A one-rank stand-in used when there is no process group: no transfers ever happen."""

    rank, world_size = 0, 1

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise ValueError(f"dst: rank {dst} does not exist in a one-rank pipeline")

    recv = send

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        pass

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        pass

    def close(self) -> None:
        pass


def _default_comm():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _SoloComm()
    from ..comm import Communicator, get_default_communicator

    try:
        return get_default_communicator()  # the one dk.init() made
    except RuntimeError:
        return Communicator()  # over the default group; every rank builds the Pipeline


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _as_tuple(value: Any, what: str) -> Tuple[Tuple[torch.Tensor, ...], bool]:
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value), True
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}")


def _unwrap(tensors: Sequence[torch.Tensor], is_tuple: bool) -> TensorOrTuple:
    return tuple(tensors) if is_tuple else tensors[0]


def _split(value: Any, n: int, arg: str) -> List[TensorOrTuple]:
    """Splits a batch (tensor or tuple of tensors, batch in dim 0) into ``n`` micro-batches."""
    tensors, is_tuple = _as_tuple(value, arg)
    for t in tensors:
        if t.dim() == 0 or t.shape[0] % n:
            size = "a 0-d tensor" if t.dim() == 0 else f"batch size {t.shape[0]}"
            raise ValueError(f"{arg}: {size} does not split into n_microbatches={n} equal parts")
    parts = [t.chunk(n) for t in tensors]
    return [_unwrap([p[i] for p in parts], is_tuple) for i in range(n)]


def _leaves(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Inputs of a stage as autograd leaves: floating tensors collect their gradient."""
    return [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]


class _SavedCounter:
    """Counts the activations autograd keeps for backward (parameters excluded)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.tensors = 0
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.param_storages:
            self.tensors += 1
            self.bytes += t.numel() * t.element_size()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class Pipeline:
    """Pipeline-parallel training of a model split into stages over the ranks of ``comm``.

    Args:
        module_or_stages: an ``nn.Sequential`` (split here, the same way on every rank) or the
            full list of stage modules (each rank keeps its own).
        comm: the pipeline's Communicator (one rank per stage), a :class:`~dist_kernels.ProcessMesh`
            (pipeline over ``mesh.pp_comm``, gradients averaged over ``mesh.dp_cp_comm``: dp x
            cp, the ranks holding the same stage's weights; ``mesh.dp_comm`` when cp = 1), or None
            for the default communicator (one process without a process group: one rank).
        n_microbatches: micro-batches per step; the batch size must be a multiple.
        schedule: one of ``dk.pipeline.SCHEDULES``: ``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, or the zero-bubble ``"zb-h1"``, ``"zb-h2"``, ``"zb-v"``,
            ``"dualpipe-v"`` (docs/pipeline.md compares them).
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch, mean-reduced.
        split_points: where stages 1.. begin (child indices or names), for an ``nn.Sequential``.
        balance: children per stage, for an ``nn.Sequential``.
        checkpoint_activations: recompute each stage's forward in backward
            (``torch.utils.checkpoint``) instead of keeping its activations.
        stages_per_rank: virtual stages per rank for ``"interleaved-1f1b"`` (default 2).
        print_partition: print the split (on global rank 0).
        find_unused_parameters: with a ProcessMesh of ``dp > 1``, passed to each stage's
            :class:`~dist_kernels.DistributedDataParallel` (parameters of a stage that get no
            gradient in its last micro-batch's backward).
        stage_loss: ``stage_loss(stage_module)``, called right after each forward of a stage
            on this rank: a scalar that micro-batch adds to its loss at that stage (None adds
            nothing). It is backpropagated from its own stage, divided by ``n_microbatches``
            and scaled as the loss is, so no stage waits for another's: Megatron's way with
            the MoE layers' load-balancing losses (``stage_loss=dk.moe.aux_loss_of``). The loss
            :meth:`step` returns includes it, summed over the stages.
        reduce_gradients: with a ProcessMesh of ``dp x cp > 1``, whether the pipeline averages
            each stage's gradients over ``mesh.dp_cp_comm`` (a DDP per stage, overlapped with
            the last backward). False leaves them local, summed over the micro-batches, for an
            optimizer that reduces them itself: a :class:`~dist_kernels.ShardedOptimizer` at
            stage 1 over ``mesh.dp_cp_comm``, whose ``step()`` reduce-scatters them (run
            ``step()`` inside its ``no_sync()``; DeepSpeed's ZeRO-1 with its pipeline, and
            Megatron's distributed optimizer, work this way).
    """

    def __init__(
        self,
        module_or_stages: Union[nn.Sequential, Sequence[nn.Module]],
        comm: Any = None,
        *,
        n_microbatches: int,
        schedule: str = "1f1b",
        loss_fn: Callable[[Any, Any], torch.Tensor],
        split_points: Optional[Sequence[Union[int, str]]] = None,
        balance: Optional[Sequence[int]] = None,
        checkpoint_activations: bool = False,
        stages_per_rank: Optional[int] = None,
        print_partition: bool = True,
        find_unused_parameters: bool = False,
        stage_loss: Optional[Callable[[nn.Module], Optional[torch.Tensor]]] = None,
        reduce_gradients: bool = True,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if stage_loss is not None and not callable(stage_loss):
            raise TypeError(f"stage_loss must be callable, got {type(stage_loss).__name__}")
        self.stage_loss = stage_loss
        self.comm, self.dp_comm, self.expert_comm = self._resolve_comm(comm)
        self.rank, self.n_ranks = self.comm.rank, self.comm.world_size
        self.schedule = build_schedule(schedule, self.n_ranks, n_microbatches, stages_per_rank)
        check_schedule(self.schedule)  # plan first: never run a schedule that fails on paper
        self.n_stages = self.schedule.n_stages
        self.n_microbatches = n_microbatches
        self.current_microbatch: Optional[int] = None  # the one an action computes, in step()
        self.loss_fn = loss_fn
        self.checkpoint_activations = bool(checkpoint_activations)
        self.stages = self._select_stages(module_or_stages, split_points, balance)
        modules = list(self.stages.values())
        self._stage_module = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        if print_partition and _global_rank() == 0:
            print(self.partition_text, flush=True)
        self.actions = self.schedule.actions[self.rank]
        self._compute_order = runtime_order(self.actions)
        self.channels = Channels(self.comm)
        self._handlers = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward_input,
            Kind.BACKWARD_WEIGHT: self._backward_weight,
            Kind.SEND_ACT: self._send,
            Kind.SEND_GRAD: self._send,
            Kind.RECV_ACT: self._recv,
            Kind.RECV_GRAD: self._recv,
        }
        self._timer: Optional[ActionTimer] = None  # set while profile() runs
        self.stats: Dict[str, int] = {}
        self._failed: Optional[str] = None
        if self.tied:  # copies start as the first stage's (ranks may have seeded apart)
            share = functools.partial(share_values, self.tied, self.comm, self.schedule.rank_of)
            self._guard(None, "sharing the first stage's tied parameters", share)
        self.ddp = self._wrap_data_parallel(find_unused_parameters) if reduce_gradients else {}
        self._scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # step()'s
        self._parameter_nodes = {
            s: parameter_nodes(list(m.parameters())) for s, m in self.stages.items()
        }
        self._deferred = self._linear_split_stages()
        # Per stage, the micro-batch whose backward the schedule runs last: it all-reduces.
        self._last_backward = {
            a.stage: a.microbatch
            for a in self.actions
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)
        }

    # ------------------------------------------------------------------ construction

    def _linear_split_stages(self) -> Dict[int, Recorder]:
        """Per stage whose I/W split takes the Linear path (``pipeline/split_linear.py``), the
        recorder hooked on its Linears (one forward hook each, idle outside this pipeline's
        forwards): a stage this rank splits whose trainable parameters are all plain
        Linears'.
        Not with activation checkpointing: the recorded inputs would outlive the forward that
        checkpointing drops them from; those stages take the generic split."""
        split = {a.stage for a in self.actions if a.kind is Kind.BACKWARD_INPUT}
        if self.checkpoint_activations:
            return {}
        return {
            s: Recorder(linear_modules(self.stages[s]))
            for s in sorted(split)
            if supports(self.stages[s])
        }

    @staticmethod
    def _resolve_comm(comm: Any):
        from ..mesh import ProcessMesh

        if isinstance(comm, ProcessMesh):  # experts sharded over ep: their replicas reduce them
            return comm.pp_comm, comm.dp_cp_comm, comm.expert_dp_comm if comm.ep > 1 else None
        comm = _default_comm() if comm is None else comm
        for attr in ("rank", "world_size", "send", "recv", "broadcast"):
            if not hasattr(comm, attr):
                raise TypeError(f"comm: {type(comm).__name__} has no {attr!r}; pass a Communicator")
        return comm, None, None

    def _select_stages(self, module_or_stages, split_points, balance) -> Dict[int, nn.Module]:
        mine = self.schedule.stages_of(self.rank)
        if isinstance(module_or_stages, nn.Sequential):
            spans = plan_partition(module_or_stages, self.n_stages, split_points, balance)
            self.partition_text = format_partition(module_or_stages, spans, self.n_ranks)
            # every stage (sharing the children: no copy) to find the parameters they share
            stages = [build_stage(module_or_stages, span) for span in spans]
            self.tied = untie(stages, mine)
            return {s: stages[s] for s in mine}
        if split_points is not None or balance is not None:
            raise ValueError("split_points and balance need an nn.Sequential, not a stage list")
        if not isinstance(module_or_stages, (list, tuple, nn.ModuleList)):
            raise TypeError(
                "module_or_stages must be an nn.Sequential or a list of stage modules, got "
                f"{type(module_or_stages).__name__}"
            )
        stages = list(module_or_stages)
        if len(stages) != self.n_stages:
            raise ValueError(
                f"module_or_stages: {len(stages)} stages given; the {self.schedule.name} "
                f"schedule on {self.n_ranks} ranks needs {self.n_stages}"
            )
        self.tied = untie(stages, mine)
        self.partition_text = "\n".join(
            f"stage {s} (rank {self.schedule.rank_of(s)}): {type(m).__name__}, "
            f"{sum(p.numel() for p in m.parameters()):,} parameters"
            for s, m in enumerate(stages)
        )
        return {s: stages[s] for s in mine}

    def _wrap_data_parallel(self, find_unused: bool) -> Dict[int, nn.Module]:
        """One DistributedDataParallel per stage of this rank over ``dp_comm`` (dp > 1 only).

        Stages are wrapped in stage order, the same on every replica, since construction is
        collective over ``dp_comm`` (it also broadcasts the parameters from replica 0). A stage
        without trainable parameters has nothing to average and is not wrapped (every replica
        of a stage has the same structure, so they all skip it).
        """
        if self.dp_comm is None or self.dp_comm.world_size <= 1:
            return {}
        from ..ddp import DistributedDataParallel

        return {
            s: DistributedDataParallel(
                module,
                self.dp_comm,
                find_unused_parameters=bool(find_unused),
                expert_comm=self.expert_comm,
            )
            for s, module in sorted(self.stages.items())
            if any(p.requires_grad for p in module.parameters())
        }

    @property
    def stage_module(self) -> nn.Module:
        """This rank's stage, or an ``nn.ModuleList`` of its stages (interleaved): the user's
        modules, never the DistributedDataParallel wrappers (those are in :attr:`ddp`)."""
        return self._stage_module

    def parameters(self):
        """Parameters of this rank's stages (what its optimizer updates)."""
        return self.stage_module.parameters()

    # ------------------------------------------------------------------ one step

    def step(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch over all micro-batches; returns the batch loss.

        ``inputs`` are needed on the rank of the first stage and ``targets`` on the rank of the
        last; other ranks may pass them or None. Gradients accumulate into ``.grad`` like
        ``loss.backward()``; with a ProcessMesh they are then averaged over the data-parallel
        replicas. The returned loss, a float64 scalar on every rank of the pipeline, is the mean of
        the micro-batch losses (this replica's, with data parallelism).

        ``scale_loss``: applied to each micro-batch's loss before its backward (the last
        stage's), as Megatron's ``grad_scale_func``: ``scale_loss=scaler.scale`` for a
        ``torch.amp.GradScaler`` or a :class:`dist_kernels.LossScaler`. Every stage's gradients
        then carry the scale; unscale them through the scaler before the optimizer steps. The
        returned loss is unscaled.
        """
        if self._failed:
            raise PipelineError(f"the pipeline failed earlier and is closed: {self._failed}")
        if scale_loss is not None and not callable(scale_loss):
            raise TypeError(f"scale_loss must be callable, got {type(scale_loss).__name__}")
        self._scale_loss = scale_loss
        started = time.perf_counter()
        self._begin_or_close(inputs, targets)
        begun = time.perf_counter()
        for action in self._compute_order:
            self._execute(action)
        ended = time.perf_counter()
        self._guard(None, "waiting for this step's sends", self._wait_sends)
        # With dp > 1 each stage's DDP already averaged its gradients at the end of the stage's
        # last backward (it waits for its all-reduces before that backward returns). The sum
        # over a tied parameter's copies is linear: after DDP's average as well as before.
        if self.tied:
            exchange = functools.partial(
                exchange_grads, self.tied, self.comm, self.schedule.rank_of
            )
            self._guard(None, "exchanging the gradients of tied parameters", exchange)
        sent = time.perf_counter()
        loss = self._finish_loss()
        if self._timer is not None:  # the step's own costs, outside its actions
            finished = time.perf_counter()
            self._timer.step_costs.append((begun - started + sent - ended, finished - sent))
        return loss

    @torch.no_grad()
    def evaluate(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Forward only (validation): the mean over the micro-batches of ``loss_fn`` (default
        the pipeline's), a float64 scalar on every rank of the pipeline. No gradient, no
        activations kept, no ``stage_loss``; the stages run in eval mode and are put back.

        Each rank runs its stages in stage order, every micro-batch of one stage before the
        next stage, and sends each output on at once (isend): the ranks work at the same time
        as in a GPipe forward, also when a rank holds two stages (interleaved, or the V of
        ZB-V, whose first rank holds the first and the last stage). Collective over the
        pipeline, like :meth:`step`; takes ``inputs`` and ``targets`` as it does.
        """
        if self._failed:
            raise PipelineError(f"the pipeline failed earlier and is closed: {self._failed}")
        loss_fn = self.loss_fn if loss_fn is None else loss_fn
        self._begin_or_close(inputs, targets)
        modes = {s: m.training for s, m in self.stages.items()}
        for module in self.stages.values():
            module.eval()
        try:
            local: Dict[Tuple[int, int], Tuple[List[torch.Tensor], bool]] = {}
            for s in sorted(self.stages):  # stage by stage: each rank starts on the first
                for mb in range(self.n_microbatches):  # micro-batch that reaches it
                    what = f"evaluation: forward of stage {s}, micro-batch {mb}"
                    run = functools.partial(self._evaluate_stage, s, mb, local, loss_fn)
                    self._guard(None, what, run)
            self._guard(None, "waiting for the evaluation's sends", self._wait_sends)
            return self._finish_loss()
        finally:
            for s, module in self.stages.items():
                module.train(modes[s])

    def _evaluate_stage(self, s: int, mb: int, local: Dict, loss_fn: Callable) -> None:
        """One stage's forward of one micro-batch in :meth:`evaluate`."""
        if s == 0:
            tensors, is_tuple = _as_tuple(self.inputs[mb], "inputs")
        elif (s - 1) in self.stages:
            tensors, is_tuple = local.pop((s - 1, mb))
        else:
            source = self.schedule.rank_of(s - 1)
            tensors, is_tuple = self.channels.recv(source, (ACTIVATION, s - 1, mb))
        out = self.stages[s](*tensors)
        if s == self.n_stages - 1:
            self.losses.append(loss_fn(out, self.targets[mb]).detach())
            return
        outs, out_is_tuple = _as_tuple(out, f"the output of stage {s}")
        if (s + 1) in self.stages:
            local[(s, mb)] = (list(outs), out_is_tuple)
        else:
            peer = self.schedule.rank_of(s + 1)
            tag = (ACTIVATION, s, mb)
            self._send_works += self.channels.send(list(outs), out_is_tuple, peer, tag)

    def profile(self, inputs: Any = None, targets: Any = None, *, steps: int = 3) -> Dict:
        """Measures the per-action times of this pipeline on its real model, for the simulator.

        Runs ``steps`` training steps (the first only warms up when there are several) timing
        every action, then agrees with the other ranks of the pipeline (collective): returns
        ``{"times": {...}, "p2p": seconds}``, the same on every rank, so that
        ``dk.pipeline.simulate(name, n_ranks, n_microbatches, **pipe.profile(x, y))`` predicts
        a schedule from this model's own times (``pipeline/profiling.py`` says what each
        number is). Gradients accumulate as in :meth:`step`: zero them afterwards.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        timer = ActionTimer()
        for i in range(steps):
            self._timer = timer if i > 0 or steps == 1 else None
            try:
                self.step(inputs, targets)
            finally:
                self._timer = None
        times = self._guard(None, "profile", lambda: gather_times(timer, self.n_stages, self.comm))
        peer = self.schedule.rank_of(1) if self.n_stages > 1 else 0
        nbytes = self.channels.sent_bytes(peer, ACTIVATION) if self.rank == 0 else 0
        p2p = self._guard(None, "profile", lambda: measure_p2p(self.comm, nbytes))
        if self.n_ranks > 1:  # the loss broadcast reaches the other ranks one latency later
            times["step"] += p2p + times["recv"]
        return {"times": times, "p2p": p2p}

    def _wait_sends(self) -> None:
        works, self._send_works = self._send_works, []
        for work in works:
            work.wait()

    def _begin_or_close(self, inputs: Any, targets: Any) -> None:
        """:meth:`_begin`; bad input closes the communicators first: peers would otherwise
        wait for this rank forever, and now raise too."""
        try:
            self._begin(inputs, targets)
        except (TypeError, ValueError) as exc:
            self._failed = str(exc)
            self._close_after_failure()
            raise

    def _begin(self, inputs: Any, targets: Any) -> None:
        m = self.n_microbatches
        first, last = 0 in self.stages, self.n_stages - 1 in self.stages
        if first and inputs is None:
            raise ValueError(f"[rank {_global_rank()}] inputs: required on the first stage")
        if last and targets is None:
            raise ValueError(f"[rank {_global_rank()}] targets: required on the last stage")
        self.inputs = _split(inputs, m, "inputs") if first else None
        self.targets = _split(targets, m, "targets") if last else None
        self.arrived: Dict[Tuple[Kind, int, int], Tuple] = {}  # (RECV_*, s, mb) -> (tensors, tup)
        self.outbox: Dict[Tuple[Kind, int, int], Tuple] = {}  # (SEND_*, stage, mb) -> ditto
        self._send_works: List[Any] = []  # isend works of this step, waited for at its end
        self._receives = receives_by_peer(self.actions)  # per peer, in list order
        self.saved: Dict[Tuple[int, int], Tuple] = {}  # (stage, mb) -> forward state
        # (stage, mb) -> (the W half of an I, the bytes its activations hold)
        self.weight_halves: Dict[Tuple[int, int], Tuple[Optional[WeightGradient], int]] = {}
        self.recordings: Dict[Tuple[int, int], Recording] = {}  # the Linear path's, per F
        self.losses: List[torch.Tensor] = []
        # (stage, mb) -> its stage_loss, until its backward; and every one's value, for the loss
        self.stage_losses: Dict[Tuple[int, int], torch.Tensor] = {}
        self.stage_loss_values: List[torch.Tensor] = []
        self.stats = {"saved_tensors": 0, "saved_bytes": 0, "peak_saved_bytes": 0}
        self._live_bytes = 0

    def _execute(self, action: Action) -> None:
        handler = self._handlers[action.kind]
        # which micro-batch the stages compute: keys of counter-based dropout masks
        # (dk.models.dropout), asked in forward and again in a recomputing backward; restored
        # after, as a receive may run inside a compute step
        outer, self.current_microbatch = self.current_microbatch, action.microbatch
        try:
            if self._timer is None:
                self._guard(action, action.describe(), lambda: handler(action))
            else:  # the runtime's own cost of an action counts as the action's
                self._timer.run(
                    action, lambda: self._guard(action, action.describe(), lambda: handler(action))
                )
        finally:
            self.current_microbatch = outer

    def _guard(self, action: Optional[Action], what: str, fn: Callable[[], Any]) -> Any:
        """Runs ``fn``; on failure closes the communicators and raises naming ``what``."""
        try:
            return fn()
        except Exception as exc:
            if getattr(exc, "_pipeline_reported", False):
                raise  # a nested guard (a receive inside a compute step) already reported it
            stages = "/".join(str(s) for s in self.stages)
            stage = action.stage if action is not None else stages
            message = (
                f"[rank {_global_rank()}] pipeline stage {stage} (pipeline rank {self.rank}): "
                f"{what} failed: {type(exc).__name__}: {exc}"
            )
            self._failed = message
            error = _same_family(exc, message)
            error._pipeline_reported = True
            self._close_after_failure()
            raise error from exc

    def _close_after_failure(self) -> None:
        for comm in (self.comm, self.dp_comm, self.expert_comm):
            with contextlib.suppress(Exception):
                if comm is not None:
                    comm.close()

    # ------------------------------------------------------------------ compute

    def _stage_inputs(self, stage: int, mb: int) -> Tuple[List[torch.Tensor], bool]:
        if stage == 0:
            tensors, is_tuple = _as_tuple(self.inputs[mb], "inputs")
            return list(tensors), is_tuple
        return self._take((Kind.RECV_ACT, stage, mb))

    def _forward(self, a: Action) -> None:
        tensors, is_tuple = self._stage_inputs(a.stage, a.microbatch)
        # The first stage's inputs are data: no gradient to send back for them.
        leaves = _leaves(tensors) if a.stage > 0 else [t.detach() for t in tensors]
        module = self.stages[a.stage]
        counter = _SavedCounter(list(module.parameters()))
        recorder = contextlib.nullcontext()
        if a.stage in self._deferred:  # the Linear split: its Linears' calls, for I and W
            recording = self.recordings[(a.stage, a.microbatch)] = Recording()
            recorder = self._deferred[a.stage].recording(recording)
        with counter.hooks(), self._dp_context(a), recorder:
            module = self.ddp.get(a.stage, module)
            if self.checkpoint_activations:
                # Saves only the stage's inputs, through these hooks (counted), to recompute.
                out = checkpoint(module, *leaves, use_reentrant=False)
            else:
                out = module(*leaves)
        outs, out_is_tuple = _as_tuple(out, f"the output of stage {a.stage}")
        extra = self._take_stage_loss(a)
        if a.stage == self.n_stages - 1:
            loss = self.loss_fn(out, self.targets[a.microbatch])
            self.losses.append(loss.detach())
            if extra is not None:  # the last stage's part joins the loss itself
                loss = loss + extra
            outs = (self._scaled(loss),)
        elif extra is not None:  # a root of its own in this stage's backward
            self.stage_losses[(a.stage, a.microbatch)] = self._scaled(extra)
        self._count_saved(counter, +1)
        self.saved[(a.stage, a.microbatch)] = (leaves, outs, counter.bytes)
        if a.stage < self.n_stages - 1:
            self._hand_over(Kind.SEND_ACT, a.stage, a.microbatch, outs, out_is_tuple)

    def _backward(self, a: Action) -> None:
        """B: the full backward of one micro-batch, input and weight gradients at once."""
        leaves, roots, grads, saved_bytes = self._backward_roots(a)
        self.recordings.pop((a.stage, a.microbatch), None)  # a full B needs none
        if roots:
            with self._dp_context(a):
                torch.autograd.backward(roots, grads)
        self._live_bytes -= saved_bytes
        self._send_input_grads(a, leaves)

    def _backward_input(self, a: Action) -> None:
        """I: the input gradient only, sent upstream at once; W computes the rest later and
        holds the activations until then (``pipeline/split.py``)."""
        leaves, roots, grads, saved_bytes = self._backward_roots(a)
        weight = None
        recording = self.recordings.pop((a.stage, a.microbatch), None)
        if roots and recording is not None:  # the Linear path, if this micro-batch fits it
            weight = backward_input_linear(roots, grads, leaves, recording)
        if roots and weight is None:
            params = self._parameter_nodes[a.stage]
            weight = backward_input(roots, grads or [None] * len(roots), leaves, params)
        self.weight_halves[(a.stage, a.microbatch)] = (weight, saved_bytes)
        self._send_input_grads(a, leaves)

    def _backward_weight(self, a: Action) -> None:
        """W: the weight gradients of an earlier I, into ``.grad``; frees its activations."""
        weight, saved_bytes = self.weight_halves.pop((a.stage, a.microbatch))
        if isinstance(weight, LinearWeightGradient):
            with self._dp_context(a):
                weight.run()  # one backward call: DDP's hooks all fire inside it
        elif weight is not None:
            # The generic split's groups run in one backward where DDP reduces (its pass
            # ends with the backward call that started it), one call each elsewhere.
            syncs = a.stage in self.ddp and a.microbatch == self._last_backward[a.stage]
            with self._dp_context(a):
                weight.run(one_backward=syncs)
        self._live_bytes -= saved_bytes

    def _backward_roots(self, a: Action):
        """(stage inputs, tensors to differentiate, their gradients, saved bytes) of ``a``."""
        leaves, outs, saved_bytes = self.saved.pop((a.stage, a.microbatch))
        if a.stage == self.n_stages - 1:
            return leaves, list(outs), None, saved_bytes
        received, _ = self._take((Kind.RECV_GRAD, a.stage, a.microbatch))
        floating = [t for t in outs if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(floating, received) if t.requires_grad]
        extra = self.stage_losses.pop((a.stage, a.microbatch), None)
        if extra is not None and extra.requires_grad:
            pairs.append((extra, torch.ones_like(extra)))
        return leaves, [t for t, _ in pairs], [g for _, g in pairs], saved_bytes

    def _take_stage_loss(self, a: Action) -> Optional[torch.Tensor]:
        """``stage_loss`` of the stage ``a`` just ran forward (None without one)."""
        if self.stage_loss is None:
            return None
        extra = self.stage_loss(self.stages[a.stage])
        if extra is None:
            return None
        if not isinstance(extra, torch.Tensor) or extra.numel() != 1:
            raise TypeError(
                f"stage_loss of stage {a.stage} must return a scalar tensor or None, got "
                f"{extra.shape if isinstance(extra, torch.Tensor) else type(extra).__name__}"
            )
        extra = extra.reshape(())
        self.stage_loss_values.append(extra.detach())
        return extra

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss, as backward takes it."""
        loss = loss / self.n_microbatches
        return loss if self._scale_loss is None else self._scale_loss(loss)

    def _send_input_grads(self, a: Action, leaves: Sequence[torch.Tensor]) -> None:
        if a.stage > 0:
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in leaves
                if t.is_floating_point()
            ]
            self._hand_over(Kind.SEND_GRAD, a.stage, a.microbatch, input_grads, True)

    def _count_saved(self, counter: _SavedCounter, sign: int) -> None:
        self.stats["saved_tensors"] += counter.tensors
        self.stats["saved_bytes"] += counter.bytes
        self._live_bytes += sign * counter.bytes
        self.stats["peak_saved_bytes"] = max(self.stats["peak_saved_bytes"], self._live_bytes)

    def _hand_over(self, kind: Kind, stage: int, mb: int, tensors, is_tuple: bool) -> None:
        """Keeps a stage's output for its send, or delivers it if the next stage is here."""
        target = stage + 1 if kind is Kind.SEND_ACT else stage - 1
        detached = [t.detach() for t in tensors]
        if target in self.stages:
            recv_kind = Kind.RECV_ACT if kind is Kind.SEND_ACT else Kind.RECV_GRAD
            self.arrived[(recv_kind, target, mb)] = (detached, is_tuple)
        else:
            self.outbox[(kind, stage, mb)] = (detached, is_tuple)

    # ------------------------------------------------------------------ transfers

    def _take(self, key: Tuple[Kind, int, int]) -> Tuple:
        """The tensors of receive ``key``, receiving from its peer in list order until here.

        Receives run lazily, when a step needs their tensor, and each peer's in list order,
        which is the order that peer sent them (one FIFO per peer); a late message from one
        peer never holds up another's. Deadlock-free: this thread blocks only in a receive
        the validated list expects next from that peer, and sends never wait for this rank's
        compute (isend); the checker (``pipeline/checker.py``) runs every list this way.
        """
        source = key[1] - 1 if key[0] is Kind.RECV_ACT else key[1] + 1
        queue = self._receives.get(self.schedule.rank_of(source))
        while key not in self.arrived:
            if not queue:
                raise RuntimeError(f"the schedule has no receive for {key}")
            self._execute(queue.popleft())
        return self.arrived.pop(key)

    def _send(self, a: Action) -> None:
        tensors, is_tuple = self.outbox.pop((a.kind, a.stage, a.microbatch))
        wire_kind = ACTIVATION if a.kind is Kind.SEND_ACT else GRADIENT
        tag = (wire_kind, a.stage, a.microbatch)
        self._send_works += self.channels.send(tensors, is_tuple, a.peer, tag)

    def _recv(self, a: Action) -> None:
        # The sender tags the transfer with its own stage: one below for activations.
        if a.kind is Kind.RECV_ACT:
            tag = (ACTIVATION, a.stage - 1, a.microbatch)
        else:
            tag = (GRADIENT, a.stage + 1, a.microbatch)
        self.arrived[(a.kind, a.stage, a.microbatch)] = self.channels.recv(a.peer, tag)

    # ------------------------------------------------------------------ after the step

    def _finish_loss(self) -> torch.Tensor:
        """The step's loss on every rank: the last stage's mean, plus each stage's
        ``stage_loss`` summed over the micro-batches / n (an all-reduce over the stages)."""
        last_rank = self.schedule.rank_of(self.n_stages - 1)
        if self.rank == last_rank:
            value = torch.stack(self.losses).double().mean().reshape(1)
        else:
            value = torch.zeros(1, dtype=torch.float64)
        if self.stage_loss_values:
            value += torch.stack(self.stage_loss_values).double().sum() / self.n_microbatches
        if self.n_ranks == 1:
            return value[0]
        if self.stage_loss is None:
            self._guard(None, "loss broadcast", lambda: self.comm.broadcast(value, last_rank))
        else:
            self._guard(None, "loss all-reduce", lambda: self.comm.all_reduce(value))
        return value[0]

    def _dp_context(self, a: Action):
        """``no_sync()`` of the stage's DDP, except for its last micro-batch (which reduces).

        DDP decides at forward time whether the next backward reduces, but 1F1B and interleaved
        schedules run other backward passes between a stage's last forward and its last
        backward. So each backward also sets DDP's switch
        (:meth:`~dist_kernels.DistributedDataParallel.set_requires_gradient_sync`) for itself:
        only the last one all-reduces (the sum accumulated over all micro-batches), overlapping
        with that backward.
        Non-reentrant checkpointing recomputes the forward inside backward, under the same
        context, so it leaves the arming as set here.
        """
        ddp = self.ddp.get(a.stage)
        if ddp is None:
            return contextlib.nullcontext()
        last = a.microbatch == self._last_backward[a.stage]
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            ddp.set_requires_gradient_sync(last)
        return contextlib.nullcontext() if last else ddp.no_sync()


def _same_family(exc: Exception, message: str) -> Exception:
    """A ``CommError`` stays a ``CommError`` (peers lost); anything else is a PipelineError."""
    if type(exc).__name__ == "CommError":
        with contextlib.suppress(Exception):
            return type(exc)(message)
    return PipelineError(message)
