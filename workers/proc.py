"""What a daemon measures of its own process, and how it paces its waits.

Resident memory, recorded in its metrics rows:

    SELECT step, "memory/rss_mb" FROM metrics ORDER BY step          -- the trainer over time
    SELECT generator_id, max(rss_mb) FROM generator_metrics GROUP BY 1

Waits (the trainer for groups, a generator for admission) poll with `poll_delays`.

Every daemon allocates Arrow's memory with malloc (`use_system_allocator`), which gives freed
memory back, where pyarrow's default mimalloc keeps it.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """This process's resident set size now, in MiB (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux (bytes on macOS)


ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_system_allocator() -> None:
    """Make Arrow allocate with malloc in this process and its children (unless the user chose a
    pool); call before pyarrow is imported, which reads the variable then. Every daemon reads
    Parquet files all run long (the compactor merges them, a generator's and the trainer's indexes
    read merged ones), and mimalloc (pyarrow's default) keeps the freed segments of Arrow's reader
    threads, which release_unused() does not reach. After merges of 8k, 16k and 62k groups (a copy
    of a 60-minute run's buffer) the compactor kept 136, 138 and 181 MiB with mimalloc and
    release_unused(), 124, 125 and 126 MiB with malloc (which release_unused() trims), and the three
    passes took the same time (1.94 and 2.04 s against 1.94 and 1.89 s). pyarrow.set_memory_pool()
    after the import is not enough: the compactor still kept 187-216 MiB."""
    os.environ.setdefault(ARROW_POOL_ENV, "system")


def arrow_allocator() -> str:
    """The allocator Arrow uses in this process: "system" (malloc), "mimalloc" or "jemalloc"."""
    import pyarrow as pa

    return pa.default_memory_pool().backend_name


def lower_priority(increment: int) -> None:
    """Raise this process's niceness by `increment` (lower its CPU priority); nothing at 0 or where
    the OS has no niceness. Never needs privileges: only raising it back would."""
    if increment > 0 and hasattr(os, "nice"):
        os.nice(increment)


def poll_delays(most: float, first: float = 0.01) -> Iterator[float]:
    """Pauses between the looks of a wait: `first` seconds, doubling up to `most`.

    A wait that ends soon (the other side is a step or a batch away) is noticed within about
    its own length rather than a whole poll interval, which on a fast loop was a large share of
    the wait (a trainer step of 0.4 s waiting 0.25 s per look); a long wait still looks only
    every `most` seconds.
    """
    delay = min(first, most)
    while True:
        yield delay
        delay = min(2 * delay, most)
