"""benchmarks/bench_mpi.py without mpiexec: its sizes, schedule, statistics and table."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_mpi.py")
_spec = importlib.util.spec_from_file_location("bench_mpi", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_sizes_are_whole_elements_by_factor():
    assert bench.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert bench.sizes(1, 16, 4) == [4, 16]  # at least one fp32 element
    assert bench.sizes(8, 64 << 20, 2)[-1] == 64 << 20 and len(bench.sizes(8, 64 << 20, 2)) == 24


def test_parse_size():
    assert bench.parse_size("64K") == 65536 and bench.parse_size("16MiB") == 16 << 20
    with pytest.raises(ValueError):
        bench.parse_size("lots")


def test_blocks_alternate_implementations():
    order = bench.block_order(3)
    assert order[:3] == list(bench.IMPLS) and len(order) == 9
    assert all(order.count(impl) == 3 for impl in bench.IMPLS)
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1))


def test_iterations_are_bounded():
    assert bench.iterations(8, 1 << 20) == 200
    assert bench.iterations(64 << 20, 1 << 20) == 5
    assert bench.iterations(1 << 16, 1 << 20) == 16


def test_row_columns_and_ratios():
    """busbw = algbw * 2(n-1)/n; ratios are the others' time over ours."""
    t = {"ours": 2e-6, "mpi": 4e-6, "gloo": 200e-6}
    cells = bench.row(4096, 4, t, {"ours": 0, "mpi": 0, "gloo": 1}, prev_us=3.0).split()
    assert cells[:4] == ["4096", "1024", "float", "sum"]
    us, algbw, busbw, wrong = map(float, cells[4:8])
    assert us == pytest.approx(2.0) and algbw == pytest.approx(4096 / 2e-6 / 1e9, rel=1e-3)
    assert busbw == pytest.approx(algbw * 1.5, rel=1e-3) and wrong == 0
    assert float(cells[-4]) == pytest.approx(2.0) and float(cells[-3]) == pytest.approx(100.0)
    assert float(cells[-1]) == pytest.approx(1.5)  # previous 3.0 us / ours 2.0 us
    assert len(bench.header(True).split()) == len(cells)


def test_summary_is_the_median_over_blocks():
    assert bench.summarize({"ours": [3.0, 1.0, 2.0, 100.0, 2.5]})["ours"] == 2.5
    assert math.isclose(bench.busbw_factor(2), 1.0) and math.isclose(bench.busbw_factor(8), 1.75)


def test_previous_times_reads_the_bench_json(tmp_path):
    data = {
        "meta": {"world_size": 2},
        "rows": [
            {"algorithm": "auto", "size": 65536, "in_place": {"time_us": 12.0}},
            {"algorithm": "ring", "size": 65536, "in_place": {"time_us": 99.0}},
        ],
    }
    path = tmp_path / "prev.json"
    path.write_text(json.dumps(data))
    assert bench.previous_times(str(path), 2) == {65536: 12.0}
    assert bench.previous_times(str(path), 4) == {}
