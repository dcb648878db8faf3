"""What a daemon measures of its own process: resident memory, recorded in its metrics rows.

    SELECT step, "memory/rss_mb" FROM metrics ORDER BY step          -- the trainer over time
    SELECT generator_id, max(rss_mb) FROM generator_metrics GROUP BY 1
"""

from __future__ import annotations

import os
import resource

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """This process's resident set size now, in MiB (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux (bytes on macOS)
