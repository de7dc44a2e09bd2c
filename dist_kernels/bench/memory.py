"""This process's resident memory, from Linux's /proc: the high-water mark reset and read, as
the benchmarks measure peak memory on CPU (where torch keeps no allocator statistics)."""

from __future__ import annotations

import gc

__all__ = ["rss_kb", "pss_kb", "reset_peak_rss"]


def rss_kb(field: str) -> int:
    """A memory field of /proc/self/status in kB: ``VmRSS`` (now), ``VmHWM`` (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def pss_kb() -> int:
    """Proportional set size now (kB): a page shared by k processes counts 1/k in each. RSS
    counts it whole in every process that touched it, so a rank that reads its peer's
    registered buffer in place (zero-copy) shows the peer's bytes in its own RSS."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> int:
    """Resets the peak-RSS counter (Linux clear_refs 5); returns the RSS now, in kB.

    Large blocks that glibc's malloc keeps after a free still count as resident: a benchmark
    that compares peaks should fix ``MALLOC_MMAP_THRESHOLD_`` (set before the process starts)
    so that freed tensors go back to the system."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_kb("VmRSS")
