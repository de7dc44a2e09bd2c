"""``python -m dist_kernels.bench --calibrate``: fit the cost model on this machine and check it.

On every rank (spawned, or under torchrun across hosts), for sizes -b to -e by -f:

1. Shared memory, on the host: every algorithm auto chooses from (all-reduce ring, tree,
   one-shot; all-gather and reduce-scatter ring, one-shot; one-shot up to one slot) is timed
   and one alpha-beta link is fitted per algorithm (:func:`~dist_kernels.comm.cost_model.
   fit_link`: least squares on the relative error).
2. Across hosts (a hierarchical communicator): each inter-host engine's all-reduce on the
   cross groups, every local rank on its own group at once, as the multi-leader path runs it;
   one link per engine.
3. The check: the fitted model's prediction against a measurement of what ``auto`` runs,
   size by size; the table prints the error and flags it beyond 15%. On one host that is the
   Communicator's ``all_reduce`` with the algorithm auto picks, timed in the rounds of step 1
   (every algorithm at every size, the fit's samples beside them, not among them); a
   prediction there adds the Communicator's own cost per call (``CostModel.call_us``,
   measured in the same rounds). Across hosts auto's hierarchical plan is timed afterwards.

Rank 0 writes the fitted links into the cost model file (``--calibrate-out``, default
``DK_COST_MODEL`` or ~/.cache/dist_kernels/cost_model.json), keeping the entries of other
host sizes and engines; communicators made afterwards decide by it. Then the projection to
1,024 ranks (dist_kernels.bench.projection) with these links and with NCCL's.

A block is ``--calib-iters`` calls (fewer at the large sizes, as ``--iter-bytes`` says) after
a barrier and a few untimed calls; its time is the slowest rank's mean per call, a
measurement's time the median of ``--calib-blocks`` blocks. The blocks go round every
measurement in turn (this VM changes speed by up to 2x for seconds at a time: measured one
after another, neighbouring sizes took 2.0, 3.3, 3.9 and 6.9 us).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from ..comm import cost_model as cm
from . import projection, report

TOLERANCE = 0.15
BLOCKS = 7
ITERS = 1000  # timed calls per block at the small sizes: a block of 100 3 us calls is 0.3 ms,
# short enough for one scheduler tick to move it by a third
BLOCK_SECONDS = 0.004  # a block's length: 1,000 3 us calls, 20 of a 200 us Gloo leg
MIN_ITERS = 3
WARMUP = 3  # untimed calls after each block's barrier: the first call after Gloo's barrier
# waits for the peer to wake from it (50-400 us on the 2-core VM)
Sample = Tuple[float, float, float]  # steps, bytes, measured us


def _timed_all(calls: List[Tuple[Callable[[], None], int]], blocks: int) -> List[float]:
    """Each (call, at most iters)'s median over blocks of the slowest rank's mean time per
    call, in us. The blocks go round: one of every call, then the next of every call, so that
    a change in the machine's speed (the 2-core VM switches between two for seconds at a time)
    reaches every size and algorithm alike instead of bending the curve a model is fitted to."""
    counts = _block_iters(calls)
    times = torch.zeros(blocks, len(calls), dtype=torch.float64)
    for b in range(blocks):
        for i, ((call, _), iters) in enumerate(zip(calls, counts)):
            dist.barrier()
            for _ in range(WARMUP):
                call()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            times[b, i] = (time.perf_counter() - start) / iters * 1e6
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.median(dim=0).values.tolist()


def _block_iters(calls: List[Tuple[Callable[[], None], int]]) -> List[int]:
    """Calls per block: enough for BLOCK_SECONDS by a first timing of each (the slowest rank's,
    so that every rank makes as many calls), within [MIN_ITERS, the call's own cap]."""
    estimate = torch.zeros(len(calls), dtype=torch.float64)
    for i, (call, _) in enumerate(calls):
        dist.barrier()
        call()  # the first call after the barrier waits for the peers to wake
        start = time.perf_counter()
        for _ in range(WARMUP):
            call()
        estimate[i] = (time.perf_counter() - start) / WARMUP
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    return [
        max(min(MIN_ITERS, cap), min(cap, math.ceil(BLOCK_SECONDS / max(seconds, 1e-9))))
        for (_, cap), seconds in zip(calls, estimate.tolist())
    ]


def _iters(nbytes: int, args) -> int:
    return min(args.calib_iters, max(args.min_iters, args.iter_bytes // max(nbytes, 1)))


def _sizes(args) -> List[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s *= args.stepfactor
    return out


def _shm_calls(local, n: int, nbytes: int, buf: torch.Tensor, out: torch.Tensor):
    """(collective, algorithm) -> a call of ``nbytes`` on the host's shared memory."""
    from .. import _C

    count = max(1, nbytes // 4)
    whole = max(n, count // n * n)
    codes = {"ring": 1, "tree": 2, "one_shot": 3}
    slot = _C.shm_slot_bytes(n)
    # Views made once: slicing in the timed call cost 0.5-2.4 us, more than the call itself.
    vector, gathered, chunk = buf[:count], out[:whole], buf[: whole // n]
    scattered, source = out[: whole // n], buf[:whole]
    calls = {}
    for collective, algorithm in cm.FITTED_ORDER:
        per_peer = nbytes if collective == "all_reduce" else whole // n * 4
        if algorithm == "one_shot" and per_peer > slot:
            continue  # one-shot runs up to one slot; beyond it the ring runs instead
        code = codes[algorithm]
        if collective == "all_reduce":
            calls[(collective, algorithm)] = lambda c=code: local.all_reduce(vector, 0, 0, c, False)
        elif collective == "all_gather":
            calls[(collective, algorithm)] = lambda c=code: local.all_gather(
                gathered, chunk, 0, c, False
            )
        else:
            calls[(collective, algorithm)] = lambda c=code: local.reduce_scatter(
                scattered, source, 0, 0, c, False
            )
    return calls, {"all_reduce": count * 4, "all_gather": whole * 4, "reduce_scatter": whole * 4}


@dataclasses.dataclass
class HostMeasurements:
    """What one round of timed blocks on the host measured (:func:`shm_samples`)."""

    samples: Dict[str, List[Tuple[int, Sample]]]  # the fit's: (size, sample) per key
    # One host only: each all-reduce algorithm through the Communicator, by (size, algorithm),
    # the check's measurements; and the Communicator's own cost per call.
    calls: Dict[Tuple[int, str], float] = dataclasses.field(default_factory=dict)
    call_us: float = 0.0


def shm_samples(local, n: int, args, comm=None) -> HostMeasurements:
    """Measured (size, sample) per "collective/algorithm" on this host, calls of the extension.

    With ``comm`` (the Communicator over ``local``, one host), the same rounds also time its
    all_reduce with each algorithm at every size, and an 8 B one-shot through it against the
    same call on the extension: the Communicator's fixed cost in Python. Timed in the same
    rounds as the fit's samples, the check and the fit see the machine in the same states."""
    largest = max(_sizes(args)) // 4 + n
    buf, out = torch.ones(largest), torch.empty(largest)
    timed: List[Tuple[Callable[[], None], int]] = []
    what: List[Tuple] = []  # per timed call: ("fit", key, size, steps, bytes) or ("call", ...)
    for size in _sizes(args):
        calls, nbytes = _shm_calls(local, n, size, buf, out)
        for (collective, algorithm), call in calls.items():
            iters = _iters(nbytes[collective], args)
            timed.append((call, iters))
            steps, coef = cm.terms(collective, algorithm, n, nbytes[collective])
            what.append(("fit", f"{collective}/{algorithm}", size, steps, coef))
            if comm is not None and collective == "all_reduce":
                t = torch.ones(max(1, size // 4))
                timed.append((lambda t=t, a=algorithm: comm.all_reduce(t, algorithm=a), iters))
                what.append(("call", size, algorithm))
    if comm is not None:
        small = torch.ones(2)
        timed.append((lambda: comm.all_reduce(small, algorithm="one_shot"), args.calib_iters))
        timed.append((lambda: local.all_reduce(small, 0, 0, 3, False), args.calib_iters))
        what += [("communicator",), ("extension",)]
    measured = HostMeasurements({})
    times = _timed_all(timed, args.calib_blocks)
    for i, row in enumerate(what):
        if row[0] == "fit":
            _, key, size, steps, coef = row
            measured.samples.setdefault(key, []).append((size, (steps, coef, times[i])))
        elif row[0] == "call":
            measured.calls[(row[1], row[2])] = times[i]
    if comm is not None:
        measured.call_us = max(0.0, times[-2] - times[-1])  # the communicator, the extension
    return measured


def inter_samples(backend, args) -> Dict[str, List[Tuple[int, Sample]]]:
    """Measured (size, sample) per engine: the cross groups' all-reduce, all at once."""
    from ..dtypes import ReduceOp

    hosts, groups = backend.hosts_n, backend.local_n
    largest = max(_sizes(args)) // 4 // groups + 1
    buf = torch.ones(largest)
    timed, rows = [], []
    for engine, leg in sorted(backend.legs.items()):
        for size in _sizes(args):
            per_group = max(1, size // 4 // groups)
            piece = buf[:per_group]
            timed.append(
                (
                    lambda leg=leg, piece=piece: leg.all_reduce(piece, ReduceOp.SUM).wait(None),
                    _iters(size, args),
                )
            )
            steps, coef = cm.terms("all_reduce", "ring", hosts, per_group * 4)
            rows.append((engine, size, steps, coef * groups))
    out: Dict[str, List[Tuple[int, Sample]]] = {}
    for (engine, size, steps, coef), us in zip(rows, _timed_all(timed, args.calib_blocks)):
        out.setdefault(engine, []).append((size, (steps, coef, us)))
    return out


def _fit(samples: Dict[str, List[Tuple[int, Sample]]], knee: bool) -> Dict[str, cm.Link]:
    return {key: cm.fit_link([s for _, s in rows], knee) for key, rows in samples.items()}


def _fit_lines(kind: str, fitted: Dict[str, cm.Link], samples) -> List[str]:
    lines = []
    for key, link in sorted(fitted.items()):
        errors = cm.relative_errors(link, [s for _, s in samples[key]])
        knee = ""
        if link.knee_bytes:
            far = 1e-3 / max(link.beta_far_us_per_byte, 1e-12)
            knee = f", {far:.3f} GB/s beyond {link.knee_bytes:.0f} B"
        lines.append(
            f"# fit {kind} {key:26s} alpha {link.alpha_us:9.3f} us, "
            f"{1e-3 / max(link.beta_us_per_byte, 1e-12):8.3f} GB/s{knee}; max |error| over its "
            f"samples {max(abs(e) for e in errors):.0%}"
        )
    return lines


def _check_auto(comm, model: cm.CostModel, args, calls=None) -> List[Tuple[int, float, float, str]]:
    """(size, predicted us, measured us, what auto runs) of comm.all_reduce(algorithm="auto").

    One host: ``calls`` holds the Communicator's all_reduce of every algorithm at every size,
    timed in the calibration's rounds (:func:`shm_samples`); the row takes the one auto now
    picks by the fitted model. What ``calls`` lacks (auto's plan across hosts; a single rank,
    which fits nothing) is timed here, in rounds of its own."""
    backend = comm._backend
    hierarchical = hasattr(backend, "settings")
    if hierarchical:
        settings = dataclasses.replace(backend.settings, model=model)  # keeps the rest
        backend.settings, backend._choices = settings, {}
    calls = calls or {}
    rows, timed = [], []
    buf = torch.ones(max(_sizes(args)) // 4 + 1)
    for size in _sizes(args):
        if hierarchical:
            choice = settings.choose(
                "all_reduce", backend.hosts_n, backend.local_n, size, sorted(backend.legs)
            )
            predicted, what = choice.predicted_us, f"{choice.kind} x{choice.chunks} {choice.engine}"
        else:
            what = _C_choice(comm, size)
            predicted = model.call_us_of("all_reduce", comm.world_size, size, what)
        measured = calls.get((size, what))
        if measured is None:
            t = buf[: max(1, size // 4)]
            timed.append((lambda t=t: comm.all_reduce(t), _iters(size, args)))
        rows.append((size, predicted, measured, what))
    fresh = iter(_timed_all(timed, args.calib_blocks) if timed else [])
    return [(size, p, next(fresh) if m is None else m, what) for size, p, m, what in rows]


def _C_choice(comm, size: int) -> str:
    names = {1: "ring", 2: "tree", 3: "one_shot"}
    return names[comm._backend.impl.resolve_all_reduce(max(1, size // 4), 0, 0)]


def _check_lines(rows, title: str) -> List[str]:
    lines = [
        f"# check: {title}: predicted against measured, |error| > {TOLERANCE:.0%} flagged",
        "#        size  auto runs                 predicted us  measured us   error",
    ]
    worst = 0.0
    for size, predicted, measured, what in rows:
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        flag = "  <-- beyond" if abs(error) > TOLERANCE else ""
        lines.append(
            f"#  {size:10d}  {what:24s} {predicted:12.1f} {measured:12.1f} {error:+7.1%}{flag}"
        )
    verdict = "within" if worst <= TOLERANCE else "beyond"
    lines.append(f"# check: worst |error| {worst:.1%} ({verdict} {TOLERANCE:.0%})")
    return lines


def add_arguments(parser) -> None:
    """The options of ``--calibrate`` and ``--project`` on the bench's parser."""
    add = parser.add_argument
    add(
        "--calibrate",
        action="store_true",
        help="fit the cost model (alpha, beta per algorithm and link) on these ranks, check it "
        "against auto's measured times, write it (see --calibrate-out); -f 4 is plenty",
    )
    add(
        "--calibrate-out",
        metavar="FILE",
        default=None,
        help="the cost model file to update (default: $DK_COST_MODEL or "
        "~/.cache/dist_kernels/cost_model.json)",
    )
    add("--calib-blocks", type=int, default=BLOCKS, help="timed blocks per size (--calibrate)")
    add(
        "--calib-iters",
        type=int,
        default=ITERS,
        help="timed calls per block at the small sizes (--calibrate; --iter-bytes shortens the "
        "large ones)",
    )
    add(
        "--project",
        action="store_true",
        help="print the projection of ring, tree and hierarchical to 1,024 ranks (8 per host) "
        "with the fitted links and with NCCL's H100 figures, then exit",
    )


def project() -> int:
    """``--project``: the projection tables, no ranks needed."""
    model = cm.load_model()
    n_local = max(model.shm) if model.shm else 2
    lines = projection.format_table(
        projection.table(_links_of(model, n_local)),
        f"projection with this machine's links ({cm.model_path()})",
    )
    lines += projection.format_table(
        projection.table(projection.NCCL_H100), "projection with NCCL's H100 figures"
    )
    print("\n".join(lines), flush=True)
    return 0


def run_rank(args, command: str) -> None:
    """The whole calibration on this rank; rank 0 prints and writes the model."""
    import dist_kernels as dk

    comm = dk.Communicator(timeout=datetime.timedelta(seconds=args.timeout))
    rank = comm.rank
    backend = comm._backend
    hierarchical = hasattr(backend, "legs")
    local = backend.local if hierarchical else backend
    n_local = backend.local_n if hierarchical else comm.world_size
    lines = [
        f"# calibrate: {command}",
        f"# date {report.utc_now()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, machine {report.machine_info()}",
    ]
    model = cm.load_model(args.calibrate_out)
    calls = {}
    if n_local > 1:
        measured = shm_samples(local, n_local, args, comm=None if hierarchical else comm)
        fitted = _fit(measured.samples, knee=True)
        model.shm[n_local] = fitted
        lines += _fit_lines(f"shm n={n_local}", fitted, measured.samples)
        if not hierarchical:
            model.call_us[n_local], calls = measured.call_us, measured.calls
            lines.append(
                f"# fit the Communicator's own cost per call (its 8 B one-shot all_reduce "
                f"against the extension's): {measured.call_us:.3f} us"
            )
    if hierarchical:
        samples = inter_samples(backend, args)
        fitted = _fit(samples, knee=False)
        model.inter.update(fitted)
        lines += _fit_lines(f"inter {backend.hosts_n} hosts x {n_local}", fitted, samples)
    model.meta = {"date": report.utc_now(), "command": command, "load": os.getloadavg()[0]}
    if hierarchical:
        backend.settings = dataclasses.replace(backend.settings, model=model)
        backend._choices = {}
        title = f"hierarchical all_reduce, {backend.hosts_n} hosts x {n_local}"
    else:
        comm.close()  # a communicator made now reads the fitted model for auto
        if rank == 0:
            cm.save_model(model, args.calibrate_out)
        dist.barrier()
        comm = dk.Communicator(timeout=datetime.timedelta(seconds=args.timeout))
        title = f"all_reduce, {comm.world_size} ranks on one host"
    rows = _check_auto(comm, model, args, calls)
    comm.close()
    if rank == 0:
        path = cm.save_model(model, args.calibrate_out)
        lines += _check_lines(rows, title)
        lines += projection.format_table(
            projection.table(_links_of(model, n_local)), "projection with the fitted links"
        )
        lines += projection.format_table(
            projection.table(projection.NCCL_H100), "projection with NCCL's H100 figures"
        )
        lines.append(f"# wrote {path}")
        print("\n".join(lines), flush=True)


def _links_of(model: cm.CostModel, n_local: int) -> projection.Links:
    """This machine's links for the projection: the host's ring all-reduce and the inter-host
    Gloo leg (its built-in default when not calibrated), at their large-message beta."""
    shm = model.shm_link(max(n_local, 2), "all_reduce", "ring")
    inter = model.inter_link("gloo")
    return projection.Links(shm.alpha_us, _far_beta(shm), inter.alpha_us, _far_beta(inter))


def _far_beta(link: cm.Link) -> float:
    return link.beta_far_us_per_byte if link.knee_bytes else link.beta_us_per_byte
