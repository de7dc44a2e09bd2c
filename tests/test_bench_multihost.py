"""benchmarks/bench_multihost.py's pure parts: sizes, bus factors, the exact references its
correctness check compares with, and the table (no hosts, no ranks)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_multihost as bm  # noqa: E402


def test_sizes_end_at_the_largest():
    assert bm.sizes(8, 64 << 20, 4)[-1] == 64 << 20
    assert bm.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert bm.parse_size("64M") == 64 << 20 and bm.parse_size("8") == 8


def test_bus_factors_follow_nccl_tests():
    assert bm.bus_factor("all_reduce", 4) == 1.5
    assert bm.bus_factor("all_gather", 4) == bm.bus_factor("reduce_scatter", 4) == 0.75


@pytest.mark.parametrize("op", bm.OPS)
def test_expected_results_are_the_exact_collective(op):
    """The reference of every rank equals torch's own reduction of all ranks' inputs."""
    n = 4
    cases = [bm._case(op, 4096, r, n) for r in range(n)]
    inputs = torch.stack([inp for _, inp, _ in cases])
    for rank, (out, _, expected) in enumerate(cases):
        if op == "all_reduce":
            assert out is None and torch.equal(expected, inputs.sum(0))
        elif op == "reduce_scatter":
            chunk = out.numel()
            assert torch.equal(expected, inputs.sum(0)[rank * chunk : (rank + 1) * chunk])
        else:
            assert torch.equal(expected, inputs.reshape(-1))


def test_table_prints_busbw_over_the_ceiling_and_ratios():
    impls = {
        "dk": {"time_us": 10.0, "algbw": 1.0, "busbw": 1.5, "wrong": 0, "iters": 5},
        "gloo": {"time_us": 30.0, "algbw": 0.3, "busbw": 0.5, "wrong": 0, "iters": 5},
    }
    result = {
        "rows": [{"op": "all_reduce", "size": 1 << 20, "impls": impls}],
        "dk_choices": {f"all_reduce {1 << 20}": "multi_leader x4 gloo"},
    }
    lines = bm.table("all_reduce", 2, "1gbit", 1e9, result)
    assert "ceiling 1.000 GB/s" in lines[0]
    row = lines[-2]
    assert row.startswith("| 1 MiB | 10.0 | 1.500 | 1.50 | 0 | 30.0 | 0.500 | 0.50 | 0 | 3.00 |")
    assert row.endswith("multi_leader x4 gloo |")


def test_phase_table_reads_every_part_against_flat_gloo():
    """--phases: each part's time and its fraction of flat Gloo's time at that size."""
    us = {p: 10.0 * (i + 1) for i, p in enumerate(bm.PHASES)}
    result = {"phases": [{"size": 64 << 20, "us": us, "dk_choice": "multi_leader x1 gloo"}]}
    lines = bm.phase_table("none", result)
    header, row = lines[4], lines[6]
    assert header.split(" | ")[1:-1] == list(bm.PHASES)
    cells = row.strip("| ").split(" | ")
    assert cells[0] == "64 MiB" and cells[-1] == "multi_leader x1 gloo"
    expected = [f"{v:.0f} ({v / 10.0:.2f})" for v in us.values()]
    assert cells[1:-1] == expected, cells
