"""Files that appear whole or not at all: atomic writes, temp names, and the errors they raise.

The lowest layer of the buffer: `buffer.fileset` and `buffer.layout` build on
it, and every daemon writes its files through `atomic_file`.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TMP_MAX_AGE_S = 3600.0  # a tmp file this old is abandoned even if its owner's pid exists


class BufferError(Exception):
    """A problem with a buffer a user can act on; the message says what and where."""


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class StorageError(BufferError, OSError):
    """A file could not be written: disk full, file-size limit, read-only filesystem, no permission.

    Still an OSError (errno and filename kept), and a user error: the message names
    the file and what to do. What was published before stays as it was.
    """

    def __init__(self, path: str | os.PathLike, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))

    def __str__(self) -> str:
        if self.errno in _FULL:
            todo = "free disk space (or raise the file-size limit), then start the daemon again"
        elif self.errno in _READ_ONLY:
            todo = "the directory is read-only or not writable by this user; make it writable or use another"
        else:
            todo = "check the filesystem, then start the daemon again"
        return (f"cannot write {self.filename}: {self.strerror} [{errno.errorcode.get(self.errno, self.errno)}]; "
                f"{todo}; files written before are intact")


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the names renamed into it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(tmp_dir: Path, final: Path, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at `final` only when the block succeeds.

    Written under a temp name in `tmp_dir`, fsynced, then renamed; if the block
    raises, the temp file is removed and `final` is untouched. On an object store
    (`final` a buffer.store.RemotePath) it is written to a local temp file, then uploaded whole. An OSError (disk
    full, read-only) comes out as a StorageError naming `final`.
    """
    if type(final).__name__ == "RemotePath":   # an object store: a local temp file, then one upload
        import tempfile
        clean_upload_spool()
        fd, local = tempfile.mkstemp(prefix=f"asyncgrpo-{os.getpid()}-", suffix=".upload")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            final.store.upload(final.key, Path(local))
        finally:
            os.unlink(local)
        return
    tmp = tmp_dir / tmp_name(final.name)
    try:
        with open(tmp, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only directory: there is no temp file either
        if isinstance(e, OSError) and not isinstance(e, StorageError) and e.errno is not None:
            raise StorageError(final, e) from e
        raise


_SPOOL_CLEANED = False


def clean_upload_spool() -> None:
    """Remove the local spool files of uploads whose process is gone (a kill -9 mid-upload), once per
    process: '<temp dir>/asyncgrpo-<pid>-*.upload'."""
    global _SPOOL_CLEANED
    if _SPOOL_CLEANED:
        return
    _SPOOL_CLEANED = True
    import tempfile
    for p in Path(tempfile.gettempdir()).glob("asyncgrpo-*-*.upload"):
        pid = p.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            p.unlink(missing_ok=True)


def atomic_write_bytes(tmp_dir: Path, final: Path, data: bytes) -> None:
    """Write `data` to `final` through a temp file in `tmp_dir` and an atomic rename."""
    with atomic_file(tmp_dir, final) as f:
        f.write(data)


def tmp_name(final_name: str) -> str:
    """'host%pid%random%<final name>.tmp': lets `clean_tmp` tell whose temp file this is."""
    return f"{socket.gethostname()}%{os.getpid()}%{uuid.uuid4().hex[:8]}%{final_name}.tmp"


def clean_tmp_dir(tmp: Path, *, max_age_s: float = TMP_MAX_AGE_S) -> int:
    """Remove temp files in `tmp` whose writer is gone (a dead pid on this host), or that are very old.

    Temp names come from `tmp_name` ('host%pid%random%final.tmp'), so a daemon
    starting up removes a crashed writer's leftovers and leaves a live one's
    (a compactor's merge in flight) alone. Returns how many were removed.
    """
    removed, host, now = 0, socket.gethostname(), time.time()
    try:
        entries = list(tmp.iterdir())
    except FileNotFoundError:
        return 0
    for p in entries:
        parts = p.name.split("%", 3)
        dead = len(parts) == 4 and parts[0] == host and parts[1].isdigit() and not pid_alive(int(parts[1]))
        try:
            if dead or now - p.stat().st_mtime > max_age_s:
                p.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
