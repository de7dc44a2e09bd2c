"""benchmarks/bench_oneccl.py: its table and round statistics always; where oneCCL and Intel MPI
are installed (tools/install_oneccl.sh; never installed by this test), the C++ program's
all-reduce checked against the exact sum at small sizes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


driver = _load("bench_oneccl")
bench_mpi = _load("bench_mpi")


def _cell(p50, p99, wrong=0):
    return {"mean_us": p50, "p50_us": p50, "p99_us": p99, "wrong": wrong}


def test_without_an_install_it_says_so_and_exits_0(tmp_path, capsys):
    assert driver.main(["--ccl-venv", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "oneCCL not installed" in out and "tools/install_oneccl.sh" in out


def test_rounds_combine_as_medians_and_wrong_adds_up():
    rounds = [
        {8: {"ours": _cell(p50, 2 * p50), "oneccl": _cell(3.0, 9.0, wrong=w)}}
        for p50, w in ((1.0, 0), (5.0, 1), (2.0, 0))
    ]
    out = driver.combine(rounds)[8]
    assert out["ours"]["p50_us"] == 2.0 and out["ours"]["p99_us"] == 4.0
    assert out["oneccl"]["wrong"] == 1


def test_table_ratios_are_theirs_over_ours():
    cells = {"ours": _cell(2.0, 4.0), "mpi": _cell(4.0, 4.0), "oneccl": _cell(3.0, 12.0)}
    header, line = driver.table({64: cells}, gloo=False)
    assert len(header.split()) == len(line.split())
    values = line.split()
    assert values[0] == "64" and values[7] == "0"  # size, #wrong
    assert [float(x) for x in values[8:]] == [1.5, 3.0, 2.0, 1.0]  # ccl p50/p99, mpi p50/p99


def test_bench_mpi_json_line_has_the_drivers_keys():
    stats = {"ours": {"mean": 2e-6, "p50": 1e-6, "p99": 3e-6}, "mpi": {"mean": float("nan")}}
    line = bench_mpi.json_line(8, 200, 5, stats, {"ours": 0, "mpi": 0})
    row = driver._json_lines('{"impl": "x"}\n' + line)[1][8]
    assert row["ours"] == {"mean_us": 2.0, "p50_us": 1.0, "p99_us": 3.0, "wrong": 0}
    assert row["mpi"]["mean_us"] is None


_INSTALL, _WHY = driver.find_install(None)


@pytest.mark.skipif(_INSTALL is None, reason=f"oneCCL not installed: {_WHY}")
def test_oneccl_program_all_reduces_correctly():
    """Every size 4 B .. 64 KiB by 4 at 2 ranks: #wrong 0 against the exact sum, and the
    statistics in order (p50 <= p99; the mean may fall either side of p50)."""
    binary = driver.build(_INSTALL)
    transport, _ = driver.choose_transport(_INSTALL, binary, 2)
    sweep = ["-b", "4", "-e", "64K", "-f", "4", "--iter-bytes", "64K", "--blocks", "2"]
    head, rows = driver.run_oneccl(_INSTALL, binary, 2, sweep, transport)
    assert head["world_size"] == 2 and head["atl"] == transport
    assert sorted(rows) == bench_mpi.sizes(4, 64 << 10, 4)
    for size, row in rows.items():
        assert row["wrong"] == 0, (size, row)
        assert 0 < row["p50_us"] <= row["p99_us"], (size, row)
        assert row["mean_us"] > 0 and row["iters"] == bench_mpi.iterations(size, 64 << 10)
