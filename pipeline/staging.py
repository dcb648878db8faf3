"""A folder that appears whole or not at all: built beside its final name, then renamed into place.

What `export` and `rescore` write goes to `.<name>.tmp-<pid>` next to the target
and is renamed to the target only when complete, so a failure or a kill leaves
no half-written target. A target that exists is replaced only when empty, or
with --force when the caller says it holds only what such a command writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from buffer.atomic import pid_alive
from pipeline.errors import DataError


def check_target(final: Path, option: str, force: bool, why_not_replace: Callable[[Path], str | None]) -> None:
    """DataError unless `final` may be written: absent, an empty folder, or (with `force`) a folder that
    `why_not_replace` accepts (it returns None, or why the folder must be kept)."""
    if not final.exists():
        return
    if not final.is_dir():
        raise DataError(f"{option} {str(final)!r} is a file; name a folder")
    entries = sorted(p.name for p in final.iterdir())
    if not entries:
        return
    if not force:
        count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        raise DataError(f"{option} {str(final)!r} is not empty ({count}, e.g. {entries[0]!r}); "
                        "name a new folder, or pass --force to replace it")
    reason = why_not_replace(final)
    if reason is not None:
        raise DataError(f"{option} {str(final)!r}: --force will not replace it: {reason}")


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A new empty folder that becomes `final` when the block succeeds (removed if it fails).

    Check `final` with `check_target` first. An existing `final` is moved aside, the
    new folder renamed in, and the old one deleted.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):   # left by a killed attempt (not a running one)
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    stage = final.parent / f".{final.name}.tmp-{os.getpid()}"
    stage.mkdir()
    try:
        yield stage
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(stage, final)
            shutil.rmtree(old)
        else:
            os.rename(stage, final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
