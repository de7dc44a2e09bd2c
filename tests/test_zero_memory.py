"""ShardedOptimizer bytes per rank, measured from its tensors, at the ZeRO paper's formula.

For every stage, FP32 and BF16 mixed precision (16-bit parameters and gradients, FP32 master,
Adam m and v), on 2 and 3 ranks: parameters, gradients and optimizer state must equal the
formula plus at most the alignment padding the plan adds (computed from the plan), and the
communication buffers equal exactly what the design allocates (staging buckets, the FP32 step
slice, at stage 3 the gathered peak of the prefetch schedule), not only the engine's own
looser bound. The allowance is smaller than one FP32 copy of a shard, so a redundant master
copy of FP32 parameters (or a second gradient shard) would fail the check, and so would a
unit left gathered after its forward.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import run_ranks  # noqa: E402
from test_zero import SEED, batch, make_comm, make_model, optimizer_spec  # noqa: E402
from test_zero_stage3 import _units, expected_peak  # noqa: E402

KINDS = ("parameters", "gradients", "optimizer_state", "buffers")
CASES = [
    (stage, dtype, opt)
    for stage in (1, 2, 3)
    for dtype in (torch.float32, torch.bfloat16)
    for opt in ("adamw", "sgd")
]


def _reports(cases):
    import dist_kernels as dk

    comm = make_comm()
    rows = []
    for stage, dtype, opt_name in cases:
        model = make_model(dtype=dtype)
        numel = sum(p.numel() for p in model.parameters())
        cls, kwargs = optimizer_spec(opt_name)
        extra = {"module": model} if stage == 3 else {}
        opt = dk.ShardedOptimizer(
            model.parameters(), cls, comm, stage=stage, bucket_cap_mb=0.001, **extra, **kwargs
        )
        for step in range(2):
            x, y = batch(step, comm.world_size, comm.rank)
            torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            opt.step()
            opt.zero_grad()
        report = opt.memory_report()
        assert all(fg.wire_dtype == fg.dtype for fg in opt.flat_groups)
        gatherer = opt._gatherer
        rows.append(
            {
                "report": report,
                "text": str(report),
                "numel": numel,
                "bucket_numel": max(b.numel for fg in opt.flat_groups for b in fg.plan.buckets),
                "peak": gatherer.peak_gathered_bytes if gatherer else 0,
                "units": _units(gatherer) if gatherer else None,
            }
        )
        opt.close()
    comm.close()
    return rows


def _buffer_bytes(stage, n, s_p, row):
    """The communication buffers of flat groups whose wire is their own dtype, from the
    engine's design (docs/zero.md): stage 1 reduce-scatters the gradient buffer in place (no
    staging); stages 2 and 3 copy gradients into two staging buffers of the largest bucket,
    one filling while the other is on the wire, and reduce-scatter them straight into the
    gradient shard (no output slice); 16-bit parameters step their FP32 master through one
    FP32 slice of the largest bucket; stage 3 adds the gathered units at their peak
    (:func:`test_zero_stage3.expected_peak`)."""
    staging = 2 * row["bucket_numel"] * s_p if stage != 1 else 0
    step_slice = 4 * row["bucket_numel"] // n if s_p != 4 else 0
    gathered = expected_peak(row["units"], n) if stage == 3 else 0
    return staging + step_slice + gathered


def _formula(stage, n, numel, s_p, state_bytes):
    """The paper's figure, written out independently of dist_kernels."""

    def per_rank(nbytes, sharded):
        return -(-nbytes * numel // n) if sharded else nbytes * numel

    return {
        "parameters": per_rank(s_p, stage == 3),
        "gradients": per_rank(s_p, stage != 1),
        "optimizer_state": per_rank(state_bytes, True),
        "buffers": 0,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_per_rank_equal_the_zero_formula(world_size):
    per_rank = run_ranks(world_size, _reports, CASES, timeout=180)
    print(f"seed {SEED}, world size {world_size}")
    for i, (stage, dtype, opt_name) in enumerate(CASES):
        for rank, rows in enumerate(per_rank):
            row = rows[i]
            report, numel = row["report"], row["numel"]
            if rank == 0:
                print(f"--- stage {stage}, {dtype}, {opt_name}\n{row['text']}")
            s_p = torch.empty((), dtype=dtype).element_size()
            state = {"adamw": 8, "sgd": 4}[opt_name] + (4 if dtype != torch.float32 else 0)
            expected = _formula(stage, world_size, numel, s_p, state)
            assert report.formula == expected, (report.formula, expected)
            for kind in KINDS:
                measured, allowance = report.measured[kind], report.allowance[kind]
                assert expected[kind] <= measured <= expected[kind] + allowance, (
                    f"rank {rank} stage {stage} {dtype} {opt_name}: {kind} {measured} B, "
                    f"formula {expected[kind]} + allowance {allowance}"
                )
            # buffers: exactly the design's, not only within the engine's own bound
            assert report.measured["buffers"] == _buffer_bytes(stage, world_size, s_p, row), (
                f"rank {rank} stage {stage} {dtype} {opt_name}: buffers "
                f"{report.measured['buffers']} B (gathered peak {row['peak']} B)"
            )
            # the padding allowance could not hide a redundant FP32 copy of the shard
            shard_fp32 = 4 * (numel // world_size)
            for kind in ("parameters", "gradients", "optimizer_state"):
                assert report.allowance[kind] < shard_fp32 / 2
            assert report.within_formula()


def test_the_check_rejects_a_redundant_master_copy():
    """The report's check fails when a shard-sized FP32 tensor is added to the state."""
    from dist_kernels.zero.memory import (
        GroupCounts,
        MemoryReport,
        formula_bytes,
        padding_allowance,
    )

    counts = [GroupCounts(1000, 1008, 504, 4, 4, 0, 8)]
    formula = formula_bytes(2, 2, counts)
    allowance = {**padding_allowance(2, 2, counts), "buffers": 0}
    good = dict(formula)
    good["optimizer_state"] += allowance["optimizer_state"]
    bad = {**good, "optimizer_state": good["optimizer_state"] + 4 * 504}
    assert MemoryReport(2, 2, 1000, good, formula, allowance, 8).within_formula()
    assert not MemoryReport(2, 2, 1000, bad, formula, allowance, 8).within_formula()
