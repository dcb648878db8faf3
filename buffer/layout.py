"""The buffer directory: its folders, the lock, writer ids, the manifests, quarantine.

```
<buffer>/
  shards/         rollout shards, write-once (w-*.parquet from writers, c-*.parquet from compaction)
  ledger/         consumption records, write-once, written by the trainer only
                  (step-<step>-<seq>.parquet per pull, step-<first>-c<gen>-<last>.parquet merged)
  ledger/manifest.json  the ledger's compaction state
  ledger/abandoned/  ledger shards of steps undone by a resume "as of step k"
  quarantine/     shards that failed to read, moved aside, each with <name>.reason.json
  tmp/            in-flight writes; ignored by readers, cleaned on open
  writers/        one small JSON file per allocated writer id
  manifest.json   the shards' compaction state: which c-files are live, which files are replaced
  buffer.lock     filelock for compaction, quarantine and allocating writer ids
```

Shards and ledger files are each a `buffer.fileset.FileSet`: readers list the
live files through its manifest, so compaction never makes a reader count a
row twice or miss one (see buffer/fileset.py).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


from buffer.atomic import (  # noqa: F401 - re-exported: the buffer's errors and atomic writes live here for callers
    BufferError,
    StorageError,
    atomic_file,
    atomic_write_bytes,
    clean_tmp_dir,
    tmp_name,
)
from buffer.fileset import FileSet, Manifest  # noqa: F401 - Manifest re-exported
from buffer.store import RemotePath, move, store_lock, store_path

BUFFER_MARKER = "buffer.json"   # on an object store (which has no folders), what makes a prefix a buffer

SHARD_SUFFIX = ".parquet"


def is_ledger_name(name: str) -> bool:
    return name.startswith("step-") and name.endswith(SHARD_SUFFIX)


def is_ledger_c_name(name: str) -> bool:
    """A merged ledger file: 'step-<first>-c<generation>-<last>.parquet'."""
    parts = name.split("-")
    return len(parts) == 4 and parts[2].startswith("c")


def ledger_range(name: str) -> tuple[int, int]:
    """(first, last) trainer step of a ledger file, from its name."""
    parts = name.removesuffix(SHARD_SUFFIX).split("-")
    first = int(parts[1])
    return (first, int(parts[3])) if ledger_is_merged(name) else (first, first)


def ledger_is_merged(name: str) -> bool:
    """Whether a ledger file's name is a merged file's (ledger_c_name, or a resume's cut of one)."""
    parts = name.removesuffix(SHARD_SUFFIX).split("-")
    return len(parts) == 4 and parts[2].startswith("c")


def ledger_c_name(generation: int, i: int, names: list[str]) -> str:
    """The name of a ledger file merged from `names`: 'step-<first>-c<generation><i>-<last>.parquet'."""
    ranges = [ledger_range(n) for n in names]
    first, last = min(r[0] for r in ranges), max(r[1] for r in ranges)
    return f"step-{first:09d}-c{generation:06d}{i:02d}-{last:09d}.parquet"


def metrics_c_name(generation: int, i: int, names: list[str]) -> str:
    """The name of a metrics file merged from `names`: 'steps-<first>-<last>-c<generation><i>.parquet'."""
    steps = [int(x) for n in names for x in n.removesuffix(SHARD_SUFFIX).split("-")[1:3]]
    return f"steps-{min(steps):09d}-{max(steps):09d}-c{generation:06d}{i:02d}.parquet"


def _is_metrics_name(name: str) -> bool:
    return name.startswith("steps-") and name.endswith(SHARD_SUFFIX)


def _is_metrics_c_name(name: str) -> bool:
    """A merged metrics file: 'steps-<first>-<last>-c<generation>.parquet'."""
    parts = name.removesuffix(SHARD_SUFFIX).split("-")
    return len(parts) == 4 and parts[3].startswith("c")


def run_file_set(folder: str | os.PathLike, kind: str) -> FileSet:
    """The trainer's metrics (kind "metrics": <run>/metrics) or the generators' ("generator_metrics").

    Each folder has its own manifest.json, compaction.lock and tmp/.
    """
    folder = folder if isinstance(folder, RemotePath) else Path(folder)
    if kind == "metrics":
        member, compacted, c_name = _is_metrics_name, _is_metrics_c_name, metrics_c_name
    elif kind == "generator_metrics":
        member, compacted, c_name = (lambda n: n.endswith(SHARD_SUFFIX)), (lambda n: n.startswith("c-")), None
    else:
        raise ValueError(f"unknown kind of run files {kind!r}: 'metrics' or 'generator_metrics'")
    return FileSet(folder, folder / "manifest.json", store_lock(folder / "compaction.lock"), folder / "tmp",
                   is_member=member, is_compacted=compacted, c_name=c_name)


class BufferDir:
    """Paths and file-level operations of one buffer directory."""

    def __init__(self, root: str | os.PathLike, *, create: bool = False):
        self.root = root if isinstance(root, RemotePath) else store_path(root).absolute()
        self.remote = isinstance(self.root, RemotePath)
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
            if self.remote and not (self.root / BUFFER_MARKER).is_file():   # no folders on object stores
                self.root.store.put_new(f"{self.root.key}/{BUFFER_MARKER}".lstrip("/"), b"{}")
        self.lock = store_lock(self.root / "buffer.lock")
        self.shard_set = FileSet(self.shards, self.manifest_path, self.lock, self.tmp,
                                 is_member=lambda n: n.endswith(SHARD_SUFFIX), is_compacted=lambda n: n.startswith("c-"))
        self.ledger_set = FileSet(self.ledger, self.ledger / "manifest.json", self.lock, self.tmp,
                                  is_member=is_ledger_name, is_compacted=is_ledger_c_name, c_name=ledger_c_name)

    @staticmethod
    def is_buffer(path) -> bool:
        if isinstance(path, RemotePath):
            return (path / BUFFER_MARKER).is_file()
        return (path / "shards").is_dir()

    # -- writer ids --------------------------------------------------------------
    def allocate_writer_id(self, generator_id: str) -> str:
        """Next free writer id ('w000007'), recorded in writers/ under the lock (on an object store:
        created if absent, the next number on a race)."""
        if not self.remote:
            with self.lock:
                writer_id = self._next_writer_id()
                atomic_write_bytes(self.tmp, self.writers / f"{writer_id}.json",
                                   self._writer_info(writer_id, generator_id))
            return writer_id
        while True:
            writer_id = self._next_writer_id()
            if self.root.store.put_new(f"{self.writers.key}/{writer_id}.json",
                                       self._writer_info(writer_id, generator_id)):
                return writer_id

    def _next_writer_id(self) -> str:
        taken = [int(p.stem[1:]) for p in self.writers.glob("w*.json") if p.stem[1:].isdigit()]
        return f"w{(max(taken) + 1 if taken else 0):06d}"

    def _writer_info(self, writer_id: str, generator_id: str) -> bytes:
        return json.dumps({"writer_id": writer_id, "generator_id": generator_id, "host": socket.gethostname(),
                           "pid": os.getpid(), "allocated_at": time.time()}).encode()

    # -- the file sets ---------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        return self.shard_set.read_manifest()

    def write_manifest(self, m: Manifest) -> None:
        """Replace the shards' manifest atomically; the caller holds the lock."""
        self.shard_set.write_manifest(m)

    def live_shard_names(self) -> list[str]:
        """File names of the live rollout shards, sorted (writer id, then sequence)."""
        return self.shard_set.live_names()

    def live_shards(self) -> list[Path]:
        """The live rollout shards, sorted by name."""
        return self.shard_set.live()

    def ledger_shard_names(self) -> list[str]:
        """File names of the live ledger files, sorted by (first) step."""
        return self.ledger_set.live_names()

    def ledger_shards(self) -> list[Path]:
        return self.ledger_set.live()

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
            move(shard, dest)
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
        return clean_tmp_dir(self.tmp)


def find_buffer(path: str | os.PathLike) -> Path:
    """A buffer directory given either the buffer itself or a run directory holding buffer/."""
    p = path if isinstance(path, RemotePath) else store_path(path)
    if BufferDir.is_buffer(p):
        return p
    if BufferDir.is_buffer(p / "buffer"):
        return p / "buffer"
    if not p.exists():
        raise BufferError(f"path not found: {p}")
    raise BufferError(f"not a buffer or run directory: {p} (expected {p}/shards/ or {p}/buffer/shards/)")
