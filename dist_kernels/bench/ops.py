"""What the benchmark runs: per-collective buffers, calls, known inputs and their reference.

Every rank's input is a pure function of (rank, element index), so any rank can rebuild every
peer's input and compute the exact expected output without communicating. Values are small
integers stored in the benchmark dtype, chosen so that sums, products, minima and maxima are
exact in every supported dtype (float16 and bfloat16 included) for any reasonable world size;
only AVG on floating types is compared with a tolerance (a division by the world size rounds).

Placement follows nccl-tests: "out-of-place" keeps the input and writes the result elsewhere,
"in-place" writes the result over the input (all_gather: the input is the rank's slice of the
output; reduce_scatter: the output is the rank's slice of the input). ``all_reduce`` and
``broadcast`` are in place in this API (as in torch.distributed), so their out-of-place form is
``out.copy_(inp)`` followed by the in-place call, and the copy is part of the time.

``sendrecv`` is nccl-tests' sendrecv_perf: every rank sends its buffer to rank + 1 while it
receives rank - 1's into another (a ring shift). It has no in-place form: a rank cannot send a
buffer while a receive overwrites it (nccl-tests times that case but does not check it).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..dtypes import ReduceOp

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "sendrecv")
REDUCING_OPS = ("all_reduce", "reduce_scatter")
PLACEMENTS = ("out_of_place", "in_place")
# Placements an op does not have, and why: their cells print n/a with this reason.
NO_PLACEMENT = {
    ("sendrecv", "in_place"): "sendrecv has no in-place form (a rank cannot send a buffer "
    "while receiving into it)",
}
# Elements compared at a time: bounds the reference's float64 / int64 memory per rank.
CHECK_BLOCK = 1 << 20

Alloc = Callable[[int], torch.Tensor]  # count -> a 1-D tensor
Runner = Callable[..., None]  # run(op, *tensors) issues one collective

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
REDOPS = ("sum", "prod", "max", "min", "avg")


def placements(op: str) -> Tuple[str, ...]:
    """The placements ``op`` has (every op has out-of-place)."""
    return tuple(p for p in PLACEMENTS if (op, p) not in NO_PLACEMENT)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw factor (S is the whole array for reduce_scatter / all_gather,
    the bytes each rank sends, and receives, for sendrecv)."""
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def element_count(op: str, size_bytes: int, itemsize: int, world_size: int) -> int:
    """Elements of the whole array for ``size_bytes``; a multiple of world_size where split."""
    count = size_bytes // itemsize
    if op in ("reduce_scatter", "all_gather"):
        return max(world_size, count // world_size * world_size)
    return max(1, count)


def _amplitude(dtype: torch.dtype, world_size: int) -> int:
    """Largest |value| (at most 3) whose sum over all ranks cannot overflow ``dtype``."""
    if dtype.is_floating_point:
        return 3
    limit = torch.iinfo(dtype).max // max(1, world_size)
    return max(1, min(3, limit if dtype != torch.uint8 else limit // 2))


def rank_values(
    rank: int, start: int, stop: int, dtype: torch.dtype, redop: str, world_size: int
) -> torch.Tensor:
    """Rank ``rank``'s input elements ``[start, stop)`` in int64 (exact in every dtype).

    prod: +-1 everywhere except one rank per element holding 2 (the product stays in {+-1, +-2});
    otherwise integers in [-a, a] ([0, 2a] for uint8), a from :func:`_amplitude`.
    """
    index = torch.arange(start, stop, dtype=torch.int64)
    if redop == "prod":
        values = torch.where((index + rank) % world_size == 0, 2, 1)
        if dtype != torch.uint8:
            values = torch.where((index * 3 + rank) % 5 == 0, -values, values)
        return values
    amplitude = _amplitude(dtype, world_size)
    values = (index * 5 + rank * 3) % (2 * amplitude + 1)
    return values if dtype == torch.uint8 else values - amplitude


def _reduce(stack: torch.Tensor, redop: str, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """Reference reduction over dim 0 of exact int64 inputs, in float64 or int64."""
    if redop == "sum":
        return stack.sum(0)
    if redop == "prod":
        return stack.prod(0)
    if redop == "max":
        return stack.max(0).values
    if redop == "min":
        return stack.min(0).values
    total = stack.sum(0)
    if dtype.is_floating_point:
        return total.double() / world_size
    return torch.div(total, world_size, rounding_mode="trunc")


def count_wrong(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements of ``got`` differing from ``expected``: exact, except AVG on floats (within
    4 ulp, the division rounds). Floating results are compared as float64, never cast to an
    integer type (a cast truncates: 2.9 would count as 2); the inputs are small integers, so
    every other exact result is an integer that float16 and bfloat16 hold exactly."""
    got = got.detach().to("cpu")
    if dtype.is_floating_point:
        got = got.double()
        if expected.dtype == torch.float64:  # AVG: a rounded quotient
            tolerance = 4 * torch.finfo(dtype).eps * expected.abs()
            return int((~((got - expected).abs() <= tolerance)).sum())  # NaN counts as wrong
        return int((got != expected.double()).sum())
    return int((got.to(torch.int64) != expected.to(torch.int64)).sum())


@dataclass
class Case:
    """One collective at one size on one rank."""

    op: str
    dtype: torch.dtype
    redop: str
    root: int
    count: int  # elements of the whole array (nccl-tests' "count")
    rank: int
    world_size: int

    @property
    def shard(self) -> int:
        """Elements each rank contributes (all_gather) or receives (reduce_scatter)."""
        if self.op in ("reduce_scatter", "all_gather"):
            return self.count // self.world_size
        return self.count

    @property
    def send_peer(self) -> int:
        """sendrecv: the rank this one sends to."""
        return (self.rank + 1) % self.world_size

    @property
    def recv_peer(self) -> int:
        """sendrecv: the rank this one receives from."""
        return (self.rank - 1) % self.world_size

    def input_count(self) -> int:
        return self.shard if self.op == "all_gather" else self.count

    def output_count(self) -> int:
        return self.shard if self.op == "reduce_scatter" else self.count

    def fill_input(self, tensor: torch.Tensor) -> None:
        for start in range(0, tensor.numel(), CHECK_BLOCK):
            stop = min(tensor.numel(), start + CHECK_BLOCK)
            values = rank_values(self.rank, start, stop, self.dtype, self.redop, self.world_size)
            tensor[start:stop].copy_(values)

    def expected(self, start: int, stop: int) -> torch.Tensor:
        """Expected output elements ``[start, stop)`` on this rank."""
        n = self.world_size
        if self.op == "broadcast":
            return rank_values(self.root, start, stop, self.dtype, self.redop, n)
        if self.op == "sendrecv":
            return rank_values(self.recv_peer, start, stop, self.dtype, self.redop, n)
        if self.op == "all_gather":
            parts = []
            for peer in range(start // self.shard, (stop - 1) // self.shard + 1):
                lo = max(start, peer * self.shard) - peer * self.shard
                hi = min(stop, (peer + 1) * self.shard) - peer * self.shard
                parts.append(rank_values(peer, lo, hi, self.dtype, self.redop, n))
            return torch.cat(parts)
        offset = self.rank * self.shard if self.op == "reduce_scatter" else 0
        stack = torch.stack(
            [
                rank_values(peer, offset + start, offset + stop, self.dtype, self.redop, n)
                for peer in range(n)
            ]
        )
        return _reduce(stack, self.redop, self.dtype, n)

    def wrong(self, output: torch.Tensor) -> int:
        wrong = 0
        for start in range(0, output.numel(), CHECK_BLOCK):
            stop = min(output.numel(), start + CHECK_BLOCK)
            wrong += count_wrong(output[start:stop], self.expected(start, stop), self.dtype)
        return wrong


def sentinel(dtype: torch.dtype) -> float:
    """A value that never appears in a correct output: a skipped write shows as #wrong."""
    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max


@dataclass
class Buffers:
    """Tensors of one placement: ``source`` holds the known input, ``result`` is checked.

    ``args`` are the tensors handed to the collective; ``copy_in`` marks the out-of-place form
    of an in-place-only collective (``result.copy_(source)`` first, timed with the call).
    """

    op: str
    source: torch.Tensor
    result: torch.Tensor
    args: Tuple[torch.Tensor, ...]
    copy_in: bool = False

    def bind(self, run: Runner) -> Callable[[], None]:
        """The zero-argument call that the benchmark checks, then times: the runner's direct
        call (a ``functools.partial`` of the collective itself, as a script calls it) where it
        has one, else ``run(op, *args)``, whose dispatch on ``op`` and keyword merging cost
        ~0.3 us per call, as much as a third of an 8-byte collective's time."""
        op, args, source, result = self.op, self.args, self.source, self.result
        direct = getattr(run, "direct", None)
        call = direct(op, args) if direct is not None and not self.copy_in else None
        if call is not None:
            return call
        if not self.copy_in:
            return lambda: run(op, *args)

        def copy_then_run() -> None:
            result.copy_(source)
            run(op, *args)

        return copy_then_run


def make_buffers(case: Case, placement: str, alloc: Alloc) -> Buffers:
    """Allocates (with ``alloc(count)``) the tensors of ``placement`` for ``case``.

    The collective is then ``run("all_reduce", t)``, ``run("reduce_scatter", out, inp)``,
    ``run("all_gather", out, inp)``, ``run("broadcast", t)`` or ``run("sendrecv", out, inp)``
    on ``Buffers.args``. ``placement`` must be one of :func:`placements` of the op.
    """
    op = case.op
    if (op, placement) in NO_PLACEMENT:
        raise ValueError(f"placement: {NO_PLACEMENT[op, placement]}")
    if op == "sendrecv":
        source, result = alloc(case.count), alloc(case.count)
        return Buffers(op, source, result, (result, source))
    if op in ("all_reduce", "broadcast"):
        result = alloc(case.count)
        if placement == "in_place":
            return Buffers(op, result, result, (result,))
        return Buffers(op, alloc(case.count), result, (result,), copy_in=True)
    if placement == "out_of_place":
        source, result = alloc(case.input_count()), alloc(case.output_count())
    elif op == "all_gather":
        result = alloc(case.count)
        source = result[case.rank * case.shard : (case.rank + 1) * case.shard]
    else:
        source = alloc(case.count)
        result = source[case.rank * case.shard : (case.rank + 1) * case.shard]
    return Buffers(op, source, result, (result, source))


def prepare_check(case: Case, buffers: Buffers) -> None:
    """Writes the sentinel over the result, then the known input (in-place overlaps it).

    Every rank writes its own input, broadcast included: a non-root result left unchanged
    then differs from the root's values and counts as wrong.
    """
    buffers.result.fill_(sentinel(case.dtype))
    case.fill_input(buffers.source)


@dataclass
class Backend:
    """A named way of running collectives: ours with one algorithm, or the baseline."""

    name: str
    run: Runner
    is_baseline: bool = False


def _accepts_algorithm(method: Callable) -> bool:
    try:
        return "algorithm" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def algorithm_choices(comm, op: str, requested: List[str]) -> Tuple[List[str], Optional[str]]:
    """Algorithms to run for ``op``, each named by what runs, and a note on any change."""
    if op == "sendrecv":
        return ["default"], "sendrecv: point-to-point calls take no algorithm argument"
    if op in _TABLED:
        return _table_choices(op, comm.algorithm_runs(op), requested)
    if _accepts_algorithm(getattr(comm, op)):
        return requested, None
    return ["default"], f"Communicator.{op} takes no algorithm argument: ran its default"


# The collectives whose communicator says, per algorithm name, what runs
# (BaseCommunicator.algorithm_runs).
_TABLED = ("reduce_scatter", "all_gather")


def _table_choices(
    op: str, runs: Optional[Dict[str, str]], requested: List[str]
) -> Tuple[List[str], Optional[str]]:
    """reduce_scatter and all_gather have no tree, and on CUDA their "auto" is NCCL's (the
    baseline): one row per algorithm that actually runs, labelled by it."""
    if runs is None:
        return ["default"], f"Communicator.{op} has no algorithm table: ran its default"
    chosen: List[str] = []
    notes = []
    for name in requested:
        ran = runs.get(name)
        if ran is None:
            notes.append(f"{op} has no {name} algorithm: no {name} row")
        elif ran == "nccl" and name != "nccl":
            notes.append(f"{op} {name} is NCCL's own: the baseline row")
        elif ran not in chosen:
            chosen.append(ran)
            if ran != name:
                notes.append(f"{op} {name} runs the {ran}: its row is labelled {ran}")
        elif ran != name:
            notes.append(f"{op} {name} runs the {ran}: no row of its own")
    if not chosen:
        raise ValueError(f"--algorithm {'/'.join(requested)}: {'; '.join(notes)}")
    return chosen, "; ".join(notes) or None


def _ours_sendrecv(comm) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One ring shift: receive ``out`` from rank - 1 while sending ``inp`` to rank + 1.

    On CPU: ``irecv`` posted first, then ``isend``, then both waited (the transport's receive
    lane never holds up its send lane). The CUDA communicator's ``send_recv`` is one NCCL group
    per message instead: its ``isend`` and ``irecv`` are ordered on one stream, so a receive
    issued first would wait for a peer whose send is queued behind its own receive.
    """
    send_to = (comm.rank + 1) % comm.world_size
    recv_from = (comm.rank - 1) % comm.world_size
    exchange = getattr(comm, "send_recv", None)
    if exchange is not None:
        return lambda out, inp: exchange(inp, send_to, out, recv_from)

    def shift(out: torch.Tensor, inp: torch.Tensor) -> None:
        received = comm.irecv(out, recv_from)
        sent = comm.isend(inp, send_to)
        received.wait()
        sent.wait()

    return shift


def _runner(shift: Callable, direct: Callable) -> Runner:
    """run(op, *tensors) from a sendrecv shift and the bound collectives; ``run.direct`` is
    what Buffers.bind times (one list of calls serves both)."""

    def run(op: str, *tensors: torch.Tensor) -> None:
        if op == "sendrecv":
            shift(tensors[0], tensors[1])
        else:
            direct(op, tensors)()

    run.direct = direct
    return run


def ours_runner(comm, algorithm: str, redop: ReduceOp, root: int) -> Runner:
    """Calls the Communicator; ``algorithm="default"`` passes no algorithm argument."""
    extra = {} if algorithm == "default" else {"algorithm": algorithm}
    shift = _ours_sendrecv(comm)

    def direct(op: str, tensors: Tuple[torch.Tensor, ...]) -> Optional[Callable[[], None]]:
        """The collective bound to its arguments (None for sendrecv: two calls and waits)."""
        if op == "all_reduce":
            return functools.partial(comm.all_reduce, tensors[0], redop, **extra)
        if op == "reduce_scatter":
            return functools.partial(comm.reduce_scatter, tensors[0], tensors[1], redop, **extra)
        if op == "all_gather":
            return functools.partial(comm.all_gather, tensors[0], tensors[1], **extra)
        if op == "broadcast":
            return functools.partial(comm.broadcast, tensors[0], root, **extra)
        return None

    return _runner(shift, direct)


def gloo_runner(redop: str, root: int, group=None) -> Runner:
    """torch.distributed calls on ``group``: the benchmark's Gloo process group (None), or
    its "dk" group (the torch-API path over our communicator)."""
    import torch.distributed as dist

    torch_op = {
        "sum": dist.ReduceOp.SUM,
        "prod": dist.ReduceOp.PRODUCT,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG,
    }[redop]
    # all_gather_into_tensor is deprecated in favour of all_gather_single where that exists.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    shift = torch_sendrecv(group)

    def direct(op: str, tensors: Tuple[torch.Tensor, ...]) -> Optional[Callable[[], None]]:
        partial = functools.partial
        if op == "all_reduce":
            return partial(dist.all_reduce, tensors[0], op=torch_op, group=group)
        if op == "reduce_scatter":
            return partial(dist.reduce_scatter_tensor, *tensors, op=torch_op, group=group)
        if op == "all_gather":
            return partial(gather, tensors[0], tensors[1], group=group)
        if op == "broadcast":
            return partial(dist.broadcast, tensors[0], root, group=group)
        return None

    return _runner(shift, direct)


def torch_sendrecv(
    group=None, batched: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One ring shift with torch.distributed on ``group``: ``irecv`` ``out`` from rank - 1,
    then ``isend`` ``inp`` to rank + 1, then wait for both. ``batched`` issues the two through
    ``batch_isend_irecv`` (NCCL: separate calls to one peer share a stream, so a receive issued
    first would wait for a send queued behind the peer's own receive)."""
    import torch.distributed as dist

    peers: List[int] = []  # (send_to, recv_from) in global ranks, found on the first call

    def shift(out: torch.Tensor, inp: torch.Tensor) -> None:
        if not peers:
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            peers.extend(((rank + 1) % world_size, (rank - 1) % world_size))
            if group is not None:  # irecv / isend name peers by global rank
                peers[:] = [dist.get_global_rank(group, p) for p in peers]
        send_to, recv_from = peers
        if batched:
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.irecv, out, recv_from, group),
                    dist.P2POp(dist.isend, inp, send_to, group),
                ]
            )
        else:
            works = [
                dist.irecv(out, src=recv_from, group=group),
                dist.isend(inp, dst=send_to, group=group),
            ]
        for work in works:
            work.wait()

    return shift
