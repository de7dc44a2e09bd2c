"""Shared-memory segments reserve their pages when created: a /dev/shm too small for a segment
raises a clear error at creation instead of killing a process with SIGBUS on first touch.

The real /dev/shm is never filled: tmpfs refuses at once a single fallocate larger than the
whole file system, which drives the same error path as a full one.
"""

from __future__ import annotations

import os
import re

import pytest

import dist_kernels
from dist_kernels import _C

SHM = "/dev/shm"


def _shm_total_bytes() -> int:
    st = os.statvfs(SHM)
    return st.f_blocks * st.f_frsize


needs_sized_shm = pytest.mark.skipif(
    not os.path.isdir(SHM) or _shm_total_bytes() == 0,
    reason="needs a /dev/shm tmpfs with a size limit",
)


@needs_sized_shm
def test_segment_larger_than_dev_shm_raises_and_leaves_nothing_behind():
    asked = _shm_total_bytes() + (1 << 30)
    with pytest.raises(dist_kernels.CommError) as info:
        _C.ShmSegment.create(asked)
    message = str(info.value)
    page = os.sysconf("SC_PAGE_SIZE")
    rounded = -(-asked // page) * page
    assert f"({rounded} bytes)" in message, message
    assert f"free of {_shm_total_bytes() / 2**30:.1f} GiB" in message, message
    assert "No space left on device" in message and "--shm-size" in message, message
    name = re.search(r"/(dk-(?:\w+-)?[0-9a-f]{16})", message)
    assert name is not None, message
    assert not os.path.exists(os.path.join(SHM, name.group(1))), "the failed segment leaked"


@needs_sized_shm
def test_created_segment_has_its_pages_reserved():
    """ftruncate alone would leave a sparse file (no blocks) that a full /dev/shm turns into a
    SIGBUS later; the segment's blocks are allocated up front."""
    segment = _C.ShmSegment.create((1 << 20) + 1)
    try:
        stat = os.stat(os.path.join(SHM, segment.name.lstrip("/")))
        assert stat.st_size == segment.size >= (1 << 20) + 1
        assert stat.st_blocks * 512 >= segment.size
        memoryview(segment)[segment.size - 1] = 7  # the last byte is usable
    finally:
        segment.unlink()
    assert not os.path.exists(os.path.join(SHM, segment.name.lstrip("/")))


def test_segment_names_carry_the_tag_of_dk_shm_tag(monkeypatch):
    """DK_SHM_TAG puts a run's tag into its segments' names (the test pools set one per run,
    so that two suites on one host see only their own segments); a tag that is not a plain
    word is refused before anything is created."""
    monkeypatch.setenv("DK_SHM_TAG", "run_7f")
    segment = _C.ShmSegment.create(4096)
    try:
        assert re.fullmatch(r"/dk-run_7f-[0-9a-f]{16}", segment.name), segment.name
        assert os.path.exists(os.path.join(SHM, segment.name.lstrip("/")))
    finally:
        segment.unlink()
    monkeypatch.delenv("DK_SHM_TAG")
    untagged = _C.ShmSegment.create(4096)
    untagged.unlink()
    assert re.fullmatch(r"/dk-[0-9a-f]{16}", untagged.name), untagged.name
    for bad in ("a/b", "a-b", "x" * 33):
        monkeypatch.setenv("DK_SHM_TAG", bad)
        with pytest.raises(ValueError, match="DK_SHM_TAG must be at most 32 letters"):
            _C.ShmSegment.create(4096)
