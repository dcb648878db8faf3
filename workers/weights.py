"""Versioned weights: HF folders published by the trainer, read by generators and eval.

```
<run>/weights/
  v00000012/        an HF model folder: *.safetensors, config.json, tokenizer files, weights.json
  LATEST            the newest version number as text ("12"), replaced atomically
  tmp/              folders and files being written; never read
  abandoned/        versions undone by a resume (see `abandon_after`), kept for audit
```

A version folder appears under its final name only when complete: it is written
in tmp/, fsynced, then renamed (`os.replace` of a directory is atomic on one
filesystem). LATEST is written after the rename, so it never names a folder
that is not there yet. Published folders are never changed; pruning renames a
folder into tmp/ before deleting it, so a reader sees a version folder either
whole or not at all (a reader that loses the race gets FileNotFoundError and
should read LATEST again).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

from buffer.atomic import fsync_dir
from buffer.layout import StorageError, atomic_file

LATEST = "LATEST"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Written by model.save_pretrained; taken from the model, never from the source folder.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")


def version_name(version: int) -> str:
    return f"v{version:08d}"


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed save: itself, or safetensors' "I/O error: ... (os error 28)"."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    m = re.search(r"\(os error (\d+)\)", str(e)) if isinstance(e, Exception) else None
    if m is not None:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    return None


class WeightStore:
    """The weights/ folder of a run: publish, find, prune versions.

    source: the model folder the run started from; its non-weight files (tokenizer
    files, markers such as asyncgrpo.json) are copied verbatim into every published
    folder, so each version loads exactly like the source. Without it the
    tokenizer's own save_pretrained output is used.
    """

    def __init__(self, root: str | os.PathLike, *, source: str | os.PathLike | None = None):
        self.root = Path(root)
        self.source = Path(source) if source is not None else None
        self.tmp = self.root / "tmp"
        self.abandoned = self.root / "abandoned"

    # -- reading -----------------------------------------------------------------
    def latest(self) -> int | None:
        """The version LATEST names, or None before the first publication."""
        try:
            text = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def folder(self, version: int) -> Path:
        """Where version `version` is (or would be) published."""
        return self.root / version_name(version)

    def versions(self) -> list[int]:
        """Published versions on disk, ascending."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
        return sorted(out)

    # -- writing (the trainer only) ----------------------------------------------
    def publish(self, model, tokenizer, version: int, *, info: dict | None = None) -> Path:
        """Save `model` (and tokenizer) as version `version`; then point LATEST at it.

        The folder is written in tmp/ and renamed into place. Publishing a version
        that is already on disk is an error (published folders never change), except
        that the same version may be published again after `abandon_after` moved it away.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        final = self.folder(version)
        if final.exists():
            raise FileExistsError(f"weights {final} are already published; published folders never change")
        self.tmp.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp / f"{socket.gethostname()}%{os.getpid()}%{uuid.uuid4().hex[:8]}%{final.name}"
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            if self.source is not None:
                self._copy_source_files(tmp)
            meta = {"version": version, "published_at": time.time(), **(info or {})}
            (tmp / "weights.json").write_text(json.dumps(meta, indent=1))
            for p in tmp.rglob("*"):
                if p.is_file():
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
            fsync_dir(tmp)
            os.replace(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = _os_error(e)
            if cause is not None:   # disk full, read-only: LATEST still names the last complete version
                raise StorageError(final, cause) from e
            raise
        fsync_dir(self.root)
        self.set_latest(version)
        return final

    def is_complete(self, version: int) -> bool:
        """Whether the folder of `version` holds what publish writes: config.json, weights, weights.json."""
        folder = self.folder(version)
        return ((folder / "config.json").is_file() and (folder / "weights.json").is_file()
                and any(folder.glob("*.safetensors")))

    def set_aside(self, version: int, reason: str) -> Path:
        """Move a damaged version folder to abandoned/ with a reason file; returns where it went."""
        self.abandoned.mkdir(parents=True, exist_ok=True)
        dest = self.abandoned / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-damaged-{version_name(version)}"
        os.replace(self.folder(version), dest)
        (dest.parent / f"{dest.name}.reason.json").write_text(json.dumps({"version": version, "reason": reason}))
        return dest

    def _copy_source_files(self, dest: Path) -> None:
        for p in self.source.iterdir():
            if not p.is_file() or p.name in MODEL_FILES or p.name.endswith(WEIGHT_SUFFIXES):
                continue
            shutil.copyfile(p, dest / p.name)

    def set_latest(self, version: int) -> None:
        """Replace LATEST atomically (temp file, fsync, rename)."""
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.tmp, self.root / LATEST) as f:
                f.write(f"{version}\n".encode())
        except OSError as e:
            raise e if isinstance(e, StorageError) else StorageError(self.root / LATEST, e) from e

    def prune(self, keep: int) -> list[int]:
        """Delete all but the `keep` newest versions (never the one LATEST names); returns those deleted."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        versions = self.versions()
        latest = self.latest()
        doomed = [v for v in versions[:-keep] if v != latest]
        for v in doomed:
            self._remove(self.folder(v))
        return doomed

    def abandon_after(self, version: int) -> list[int]:
        """Move versions newer than `version` to abandoned/ (a resume undid them); returns them.

        LATEST is pointed back at the newest version left, if it named an abandoned one.
        """
        newer = [v for v in self.versions() if v > version]
        if newer:
            self.abandoned.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for v in newer:
                os.replace(self.folder(v), self.abandoned / f"{stamp}-{os.getpid()}-{version_name(v)}")
        latest = self.latest()
        if latest is not None and latest > version:
            left = [v for v in self.versions() if v <= version]
            if left:
                self.set_latest(left[-1])
            else:
                (self.root / LATEST).unlink(missing_ok=True)
        return newer

    def clean_tmp(self) -> None:
        """Remove what a crashed publisher left in tmp/ (only the trainer publishes)."""
        if self.tmp.is_dir():
            for p in self.tmp.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def _remove(self, folder: Path) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        doomed = self.tmp / f"deleting-{uuid.uuid4().hex[:8]}-{folder.name}"
        try:
            os.replace(folder, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)
