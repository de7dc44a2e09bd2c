"""``python -m dist_kernels.bench --calibrate``: fit the cost model on this machine and check it.

On every rank (spawned, or under torchrun across hosts), for sizes -b to -e by -f:

1. Shared memory, on the host: every algorithm auto chooses from (all-reduce ring, tree,
   one-shot; all-gather and reduce-scatter ring, one-shot; one-shot up to one slot) is timed
   and one alpha-beta link is fitted per algorithm (:func:`~dist_kernels.comm.cost_model.
   fit_link`: least squares on the relative error).
2. Across hosts (a hierarchical communicator): each inter-host engine's all-reduce on the
   cross groups, every local rank on its own group at once, as the multi-leader path runs it;
   one link per engine.
3. The check: the fitted model's prediction against a fresh measurement of what ``auto`` runs
   (the algorithm it picks on one host, the hierarchical plan across hosts), size by size;
   the table prints the error and flags it beyond 15%.

Rank 0 writes the fitted links into the cost model file (``--calibrate-out``, default
``DK_COST_MODEL`` or ~/.cache/dist_kernels/cost_model.json), keeping the entries of other
host sizes and engines; communicators made afterwards decide by it. Then the projection to
1,024 ranks (dist_kernels.bench.projection) with these links and with NCCL's. A block's time
is the slowest rank's mean per call, a size's time the median of ``--calib-blocks`` blocks.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from ..comm import cost_model as cm
from . import projection, report

TOLERANCE = 0.15
BLOCKS = 5
Sample = Tuple[float, float, float]  # steps, bytes, measured us


def _timed(call: Callable[[], None], iters: int, blocks: int = BLOCKS) -> float:
    """Median over blocks of the slowest rank's mean time per call, in us."""
    call()  # warm-up
    times = torch.zeros(blocks, dtype=torch.float64)
    for b in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        times[b] = (time.perf_counter() - start) / iters * 1e6
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def _iters(nbytes: int, args) -> int:
    return min(args.iters, max(args.min_iters, args.iter_bytes // max(nbytes, 1)))


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
    calls = {}
    for collective, algorithm in cm.FITTED_ORDER:
        per_peer = nbytes if collective == "all_reduce" else whole // n * 4
        if algorithm == "one_shot" and per_peer > slot:
            continue  # one-shot runs up to one slot; beyond it the ring runs instead
        code = codes[algorithm]
        if collective == "all_reduce":
            calls[(collective, algorithm)] = lambda c=code: local.all_reduce(
                buf[:count], 0, 0, c, False
            )
        elif collective == "all_gather":
            calls[(collective, algorithm)] = lambda c=code: local.all_gather(
                out[:whole], buf[: whole // n], 0, c, False
            )
        else:
            calls[(collective, algorithm)] = lambda c=code: local.reduce_scatter(
                out[: whole // n], buf[:whole], 0, 0, c, False
            )
    return calls, {"all_reduce": count * 4, "all_gather": whole * 4, "reduce_scatter": whole * 4}


def shm_samples(local, n: int, args) -> Dict[str, List[Tuple[int, Sample]]]:
    """Measured (size, sample) per "collective/algorithm" on this host."""
    largest = max(_sizes(args)) // 4 + n
    buf, out = torch.ones(largest), torch.empty(largest)
    samples: Dict[str, List[Tuple[int, Sample]]] = {}
    for size in _sizes(args):
        calls, nbytes = _shm_calls(local, n, size, buf, out)
        for (collective, algorithm), call in calls.items():
            steps, coef = cm.terms(collective, algorithm, n, nbytes[collective])
            us = _timed(call, _iters(nbytes[collective], args), args.calib_blocks)
            samples.setdefault(f"{collective}/{algorithm}", []).append((size, (steps, coef, us)))
    return samples


def inter_samples(backend, args) -> Dict[str, List[Tuple[int, Sample]]]:
    """Measured (size, sample) per engine: the cross groups' all-reduce, all at once."""
    from ..dtypes import ReduceOp

    hosts, groups = backend.hosts_n, backend.local_n
    largest = max(_sizes(args)) // 4 // groups + 1
    buf = torch.ones(largest)
    out: Dict[str, List[Tuple[int, Sample]]] = {}
    for engine, leg in sorted(backend.legs.items()):
        for size in _sizes(args):
            per_group = max(1, size // 4 // groups)
            piece = buf[:per_group]
            us = _timed(
                lambda leg=leg, piece=piece: leg.all_reduce(piece, ReduceOp.SUM).wait(None),
                _iters(size, args),
                args.calib_blocks,
            )
            steps, coef = cm.terms("all_reduce", "ring", hosts, per_group * 4)
            out.setdefault(engine, []).append((size, (steps, coef * groups, us)))
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


def _check_auto(comm, model: cm.CostModel, args) -> List[Tuple[int, float, float, str]]:
    """(size, predicted us, measured us, what auto runs) of comm.all_reduce(algorithm="auto")."""
    backend = comm._backend
    hierarchical = hasattr(backend, "settings")
    rows = []
    buf = torch.ones(max(_sizes(args)) // 4 + 1)
    for size in _sizes(args):
        t = buf[: max(1, size // 4)]
        if hierarchical:
            settings = dataclasses.replace(backend.settings, model=model)  # keeps the rest
            choice = settings.choose(
                "all_reduce", backend.hosts_n, backend.local_n, size, sorted(backend.legs)
            )
            backend.settings, backend._choices = settings, {}
            predicted, what = choice.predicted_us, f"{choice.kind} x{choice.chunks} {choice.engine}"
        else:
            n = comm.world_size
            algorithm = _C_choice(comm, size)
            predicted = model.shm_link(n, "all_reduce", algorithm).us(
                *cm.terms("all_reduce", algorithm, n, size)
            )
            what = algorithm
        measured = _timed(lambda t=t: comm.all_reduce(t), _iters(size, args), args.calib_blocks)
        rows.append((size, predicted, measured, what))
    return rows


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
    if n_local > 1:
        samples = shm_samples(local, n_local, args)
        fitted = _fit(samples, knee=True)
        model.shm[n_local] = fitted
        lines += _fit_lines(f"shm n={n_local}", fitted, samples)
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
    rows = _check_auto(comm, model, args)
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
