"""The collective timeout's order (dist_kernels/comm/timeout.py): the argument, DK_TIMEOUT, the
group's own when set, 5 minutes; and a clear error for a bad DK_TIMEOUT."""

import datetime

import pytest

from dist_kernels.comm.timeout import DEFAULT_TIMEOUT, TORCH_DEFAULT_TIMEOUT, resolve_timeout

S = datetime.timedelta(seconds=1)


def test_order(monkeypatch):
    monkeypatch.delenv("DK_TIMEOUT", raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT == datetime.timedelta(minutes=5)
    assert resolve_timeout(None, TORCH_DEFAULT_TIMEOUT) == DEFAULT_TIMEOUT  # torch's default
    assert resolve_timeout(None, 90 * S) == 90 * S  # a group timeout somebody chose
    monkeypatch.setenv("DK_TIMEOUT", "12.5")
    assert resolve_timeout(None, 90 * S) == 12.5 * S
    assert resolve_timeout(3 * S, 90 * S) == 3 * S  # the argument wins


@pytest.mark.parametrize("text", ["0", "-3", "soon"])
def test_bad_env(monkeypatch, text):
    monkeypatch.setenv("DK_TIMEOUT", text)
    with pytest.raises(ValueError, match="DK_TIMEOUT must be a number of seconds > 0"):
        resolve_timeout(None)
