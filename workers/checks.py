"""Validation for the components' config dataclasses.

Each component owns a frozen dataclass whose `__post_init__` calls `require`;
the message names the class, the field and the bad value, and says what is
allowed, e.g. `TrainerConfig.lr must be a number > 0, got -1.0`. The pipeline
checks types and unknown keys when it reads TOML, and adds the file's key.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A config value that is out of bounds or inconsistent; the message names the field."""


def require(cfg, field: str, ok: bool, need: str) -> None:
    """Raise ConfigError unless `ok`: '<Class>.<field> must be <need>, got <value>'."""
    if not ok:
        raise ConfigError(f"{type(cfg).__name__}.{field} must be {need}, got {getattr(cfg, field)!r}")


def is_int(x, lo: int | None = None, hi: int | None = None) -> bool:
    """An int (not a bool) within [lo, hi]."""
    return (isinstance(x, int) and not isinstance(x, bool)
            and (lo is None or x >= lo) and (hi is None or x <= hi))


def is_num(x, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> bool:
    """A finite int or float (not a bool) within [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return False
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    return hi is None or x <= hi
