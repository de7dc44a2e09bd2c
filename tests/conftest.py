"""Test order: the tests marked ``two_ranks`` (two processes sharing one GPU) run after every
other selected test, so that on a lent GPU the single-process results are in before a two-rank
hang can eat the time left (benchmarks/device_check.sh runs ``pytest -m gpu``)."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("two_ranks") is not None)
