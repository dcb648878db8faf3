"""The buffer directory: its folders, the lock, writer ids, the manifest, quarantine.

```
<buffer>/
  shards/         rollout shards, write-once (w-*.parquet from writers, c-*.parquet from compaction)
  ledger/         consumption records, write-once, written by the trainer only
  ledger/abandoned/  ledger shards of steps undone by a resume "as of step k"
  quarantine/     shards that failed to read, moved aside, each with <name>.reason.json
  tmp/            in-flight writes; ignored by readers, cleaned on open
  writers/        one small JSON file per allocated writer id
  manifest.json   compaction state: which c-files are live, which files are replaced
  buffer.lock     filelock for compaction, quarantine and allocating writer ids
```

Live shards, as every reader sees them: read the manifest, then list `shards/`;
a w-file is live unless the manifest lists it as replaced, a c-file is live only
once the manifest lists it. Compaction writes its c-file first, then replaces
the manifest, and deletes replaced files only after a grace period, removing
them from the manifest after deletion. In that order a reader never counts a
row twice and never misses one.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock

SHARD_SUFFIX = ".parquet"
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


@contextmanager
def atomic_file(tmp_dir: Path, final: Path, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at `final` only when the block succeeds.

    Written under a temp name in `tmp_dir`, fsynced, then renamed; if the block
    raises, the temp file is removed and `final` is untouched. An OSError (disk
    full, read-only) comes out as a StorageError naming `final`.
    """
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


def atomic_write_bytes(tmp_dir: Path, final: Path, data: bytes) -> None:
    """Write `data` to `final` through a temp file in `tmp_dir` and an atomic rename."""
    with atomic_file(tmp_dir, final) as f:
        f.write(data)


def tmp_name(final_name: str) -> str:
    """'host%pid%random%<final name>.tmp': lets `clean_tmp` tell whose temp file this is."""
    return f"{socket.gethostname()}%{os.getpid()}%{uuid.uuid4().hex[:8]}%{final_name}.tmp"


@dataclass(frozen=True)
class Manifest:
    generation: int
    compacted: tuple[str, ...]           # live c-files
    replaced: dict[str, float]           # file name -> time it was replaced (to delete after grace)

    @staticmethod
    def empty() -> "Manifest":
        return Manifest(0, (), {})


class BufferDir:
    """Paths and file-level operations of one buffer directory."""

    def __init__(self, root: str | os.PathLike, *, create: bool = False):
        self.root = Path(root).absolute()
        if not create and not self.is_buffer(self.root):
            if not self.root.exists():
                raise BufferError(f"buffer not found: {self.root} does not exist")
            raise BufferError(f"not a buffer: {self.root} has no shards/ folder "
                              f"(pass a buffer directory or a run directory that holds buffer/)")
        self.shards = self.root / "shards"
        self.ledger = self.root / "ledger"
        self.abandoned = self.ledger / "abandoned"
        self.quarantine_dir = self.root / "quarantine"
        self.tmp = self.root / "tmp"
        self.writers = self.root / "writers"
        self.manifest_path = self.root / "manifest.json"
        if create:
            for d in (self.shards, self.ledger, self.abandoned, self.quarantine_dir, self.tmp, self.writers):
                d.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.root / "buffer.lock"))

    @staticmethod
    def is_buffer(path: Path) -> bool:
        return (path / "shards").is_dir()

    # -- writer ids --------------------------------------------------------------
    def allocate_writer_id(self, generator_id: str) -> str:
        """Next free writer id ('w000007'), recorded in writers/ under the lock."""
        with self.lock:
            taken = [int(p.stem[1:]) for p in self.writers.glob("w*.json") if p.stem[1:].isdigit()]
            writer_id = f"w{(max(taken) + 1 if taken else 0):06d}"
            info = {"writer_id": writer_id, "generator_id": generator_id, "host": socket.gethostname(),
                    "pid": os.getpid(), "allocated_at": time.time()}
            atomic_write_bytes(self.tmp, self.writers / f"{writer_id}.json", json.dumps(info).encode())
        return writer_id

    # -- manifest ----------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        try:
            raw = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            return Manifest.empty()
        except (OSError, ValueError) as e:
            raise BufferError(f"unreadable manifest {self.manifest_path}: {e}") from e
        return Manifest(int(raw["generation"]), tuple(raw["compacted"]),
                        {k: float(v) for k, v in raw["replaced"].items()})

    def write_manifest(self, m: Manifest) -> None:
        """Replace the manifest atomically; the caller holds the lock."""
        raw = {"generation": m.generation, "compacted": list(m.compacted), "replaced": m.replaced}
        atomic_write_bytes(self.tmp, self.manifest_path, json.dumps(raw, indent=1).encode())

    def live_shard_names(self) -> list[str]:
        """File names of the live rollout shards, sorted (writer id, then sequence)."""
        manifest = self.read_manifest()  # first the manifest, then the listing: see module doc
        compacted = set(manifest.compacted)
        live = []
        for name in os.listdir(self.shards):
            if not name.endswith(SHARD_SUFFIX) or name in manifest.replaced:
                continue
            if name.startswith("c-") and name not in compacted:
                continue
            live.append(name)
        live.sort()
        return live

    def live_shards(self) -> list[Path]:
        """The live rollout shards, sorted by name."""
        return [self.shards / name for name in self.live_shard_names()]

    def ledger_shard_names(self) -> list[str]:
        """File names of the ledger shards ('step-<step>-<seq>.parquet'), sorted by step."""
        return sorted(n for n in os.listdir(self.ledger) if n.startswith("step-") and n.endswith(SHARD_SUFFIX))

    def ledger_shards(self) -> list[Path]:
        return [self.ledger / name for name in self.ledger_shard_names()]

    # -- quarantine --------------------------------------------------------------
    def quarantine(self, shard: Path, reason: str) -> Path | None:
        """Move an unreadable shard to quarantine/ with a reason file; None if already gone."""
        with self.lock:
            if not shard.exists():
                return None
            dest = self.quarantine_dir / shard.name
            info = {"file": shard.name, "reason": reason, "quarantined_at": time.time(),
                    "size_bytes": shard.stat().st_size}
            atomic_write_bytes(self.tmp, self.quarantine_dir / f"{shard.name}.reason.json",
                               json.dumps(info, indent=1).encode())
            os.replace(shard, dest)
        return dest

    def quarantined(self) -> list[dict]:
        out = []
        for p in sorted(self.quarantine_dir.glob("*.reason.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                out.append({"file": p.name.removesuffix(".reason.json"), "reason": "reason file unreadable"})
        return out

    # -- tmp ---------------------------------------------------------------------
    def clean_tmp(self) -> int:
        """Remove temp files whose writer is gone (dead pid on this host, or very old)."""
        removed, host, now = 0, socket.gethostname(), time.time()
        for p in self.tmp.iterdir():
            parts = p.name.split("%", 3)
            dead = (len(parts) == 4 and parts[0] == host and parts[1].isdigit()
                    and not _pid_alive(int(parts[1])))
            try:
                if dead or now - p.stat().st_mtime > TMP_MAX_AGE_S:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_buffer(path: str | os.PathLike) -> Path:
    """A buffer directory given either the buffer itself or a run directory holding buffer/."""
    p = Path(path)
    if BufferDir.is_buffer(p):
        return p
    if BufferDir.is_buffer(p / "buffer"):
        return p / "buffer"
    if not p.exists():
        raise BufferError(f"path not found: {p}")
    raise BufferError(f"not a buffer or run directory: {p} (expected {p}/shards/ or {p}/buffer/shards/)")
