"""Published weights on object storage, and the bounded local cache generators load them from (issue 18).

```
<run>/weights/                      on the store (s3://bucket/prefix/weights/)
  v00000012/<file>                  the files of an HF folder, uploaded one by one
  v00000012/COMPLETE.json           written last, create-if-absent: {file: [size, sha256]}
  latest/latest-<n>.json            numbered states, the newest wins: {"version": 12}
<cache>/                            on the generator's machine
  v00000012-<digest>/               a verified download (digest: of its COMPLETE.json); loaded by the
                                    backend like any HF folder
  tmp/                              downloads in flight
```

The trainer uploads a version's files, then COMPLETE.json, then the next LATEST state; so a
version is visible only once every file is there, and a trainer killed mid-upload leaves files
nobody reads (COMPLETE.json absent; the next upload of that version replaces them). A generator
downloads into tmp/, checks every file's size and SHA-256 against COMPLETE.json, then renames the
folder into the cache: a partial or damaged download is never loaded. The cache keeps the
`keep` newest versions (and never deletes the one being returned). A resume withdraws the versions
it undoes (every folder past its checkpoint, whether LATEST listed it or not) and publishes them
again with other weights: the digest in a cache folder's name tells the two publications apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from buffer.atomic import BufferError, pid_alive, fsync_dir
from buffer.store import Numbered, Store
from workers.weights import WeightStore, version_name

COMPLETE = "COMPLETE.json"
_CACHED = re.compile(r"v(\d+)(?:-[0-9a-f]+)?")   # a cache folder: v<version>-<digest of COMPLETE.json>


class WeightsError(BufferError):
    """A published version that cannot be used (damaged upload, missing files); names it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def listing_of(files: list[Path]) -> dict[str, list]:
    """COMPLETE.json's content for local `files`: {name: [size, sha256]}."""
    return {p.name: [p.stat().st_size, _sha256(p)] for p in files}


class CompleteFolders:
    """Folders of write-once files on a Store, each visible only once its COMPLETE.json is there.

    `put` uploads the files, then COMPLETE.json ({file: [size, sha256]}) with create-if-absent;
    `download` checks every file against it. Weight versions and trainer checkpoints are kept so."""

    def __init__(self, store: Store, folder: str):
        self.store, self.folder = store, folder.strip("/")

    def name(self, sub: str, file: str = "") -> str:
        return f"{self.folder}/{sub}/{file}".rstrip("/")

    def subfolders(self) -> list[str]:
        """Every folder here, complete or not."""
        return self.store.list_folders(self.folder)

    def is_complete(self, sub: str) -> bool:
        return any(e.name == COMPLETE for e in self.store.list(self.name(sub)))

    def complete(self, sub: str) -> bytes | None:
        """The COMPLETE.json of `sub` as stored, None when `sub` is not (yet, or no longer) complete."""
        try:
            return self.store.read(self.name(sub, COMPLETE))
        except FileNotFoundError:
            return None

    def put(self, sub: str, files: list[Path]) -> None:
        """Upload `files` as `sub`, then its COMPLETE.json. A `sub` already complete with the same files is
        left as it is (an upload killed after COMPLETE.json); with other files it is FileExistsError."""
        if not files:
            raise WeightsError(f"no files to upload as {self.store.uri}/{self.name(sub)}")
        listing = listing_of(files)
        done = self.complete(sub)
        if done is not None:
            if json.loads(done) != listing:
                raise FileExistsError(f"{self.store.uri}/{self.name(sub)} is already published with other "
                                      f"files; published versions never change")
            return
        for p in files:
            self.store.upload(self.name(sub, p.name), p)
        if not self.store.put_new(self.name(sub, COMPLETE), json.dumps(listing, indent=1).encode()):
            raise FileExistsError(f"{self.store.uri}/{self.name(sub)} was completed by another writer")

    def withdraw(self, sub: str) -> None:
        """Make `sub` invisible: COMPLETE.json first (then no reader fetches it), then the files."""
        self.store.delete(self.name(sub, COMPLETE))
        for e in self.store.list(self.name(sub)):
            self.store.delete(self.name(sub, e.name))

    def download(self, sub: str, listing: dict, into: Path) -> None:
        """Download the files `listing` names into the local folder `into`, each checked (size, SHA-256)
        and fsynced; WeightsError names the first that does not match."""
        for name, (size, sha) in sorted(listing.items()):
            self.store.download(self.name(sub, name), into / name)
            got = (into / name).stat().st_size
            if got != size or _sha256(into / name) != sha:
                raise WeightsError(f"{self.store.uri}/{self.name(sub, name)}: {got} bytes that do "
                                   f"not match {COMPLETE} ({size} bytes, sha256 {sha[:12]}...); not loaded")
            with open(into / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(into)


class RemoteWeights:
    """The weights/ folder of a run on a Store; `cache` is a local folder for downloads (generators)."""

    def __init__(self, store: Store, *, folder: str = "weights", cache: str | os.PathLike | None = None,
                 keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.store, self.folder, self.keep = store, folder.strip("/"), keep
        self.folders = CompleteFolders(store, self.folder)
        self.cache = Path(cache) if cache is not None else None
        self._latest = Numbered(store, f"{self.folder}/latest", "latest")
        if self.cache is not None:
            self._clean_tmp()

    def _clean_tmp(self) -> None:
        """Remove downloads a killed process of this machine left in cache/tmp/ ('<pid>-...')."""
        tmp = self.cache / "tmp"
        if tmp.is_dir():
            for p in tmp.iterdir():
                pid = p.name.split("-", 1)[0]
                if p.name.startswith("deleting-") or (pid.isdigit() and not pid_alive(int(pid))):
                    shutil.rmtree(p, ignore_errors=True)

    # -- the trainer ---------------------------------------------------------------------
    def set_latest(self, version: int) -> None:
        """Point LATEST at `version` (a resume moves it back), keeping the list of published versions."""
        self._latest.update(lambda s: {"version": version, "versions": sorted(set((s or {}).get("versions", []))
                                                                               | {version})})

    def versions(self) -> list[int]:
        """The published (complete) versions, ascending, as LATEST's state lists them."""
        _, state = self._latest.read()
        return sorted((state or {}).get("versions", []))

    def _withdraw(self, versions: list[int]) -> None:
        for v in versions:
            self.folders.withdraw(version_name(v))

    def _folders(self) -> list[int]:
        """Every version with a folder on the store, complete or not, ascending."""
        return sorted(int(n[1:]) for n in self.folders.subfolders() if n[:1] == "v" and n[1:].isdigit())

    def abandon_after(self, version: int) -> list[int]:
        """Withdraw versions newer than `version` (a resume undid them) and point LATEST back.

        Also those LATEST's list never named: a trainer killed between a version's COMPLETE.json and its
        LATEST state leaves a complete version that the resumed trainer will publish again, with other
        weights; and a killed upload leaves files without COMPLETE.json."""
        newer = sorted(set(self.versions()) | set(self._folders()))
        newer = [v for v in newer if v > version]
        if not newer:
            return []

        def back(s):
            kept = [v for v in (s or {}).get("versions", []) if v <= version]
            return {"version": max(kept) if kept else -1, "versions": kept}
        self._latest.update(back)
        self._withdraw(newer)
        return newer

    def prune(self, keep: int) -> list[int]:
        """Withdraw all but the `keep` newest versions (never LATEST's)."""
        latest, versions = self.latest(), self.versions()
        doomed = [v for v in versions[:-keep] if v != latest]
        if doomed:
            self._latest.update(lambda s: {**(s or {}), "versions": [v for v in (s or {}).get("versions", [])
                                                                      if v not in doomed]})
            self._withdraw(doomed)
        return doomed

    def upload(self, local: str | os.PathLike, version: int) -> None:
        """Upload the HF folder `local` as `version`, then make it LATEST. A version already complete
        with the same files only moves LATEST (an upload killed before it); with other files it is an error
        (published versions never change)."""
        self.folders.put(version_name(version), sorted(p for p in Path(local).iterdir() if p.is_file()))
        self._latest.update(lambda s: {"version": max(version, (s or {}).get("version", -1)),
                                       "versions": sorted(set((s or {}).get("versions", [])) | {version})})

    # -- readers -------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The version LATEST names, or None before the first upload."""
        _, state = self._latest.read()
        return None if state is None or state["version"] < 0 else int(state["version"])

    def is_complete(self, version: int) -> bool:
        return self.folders.is_complete(version_name(version))

    def _cached(self, version: int) -> tuple[Path, dict]:
        """(the cache folder of `version` as now published, its COMPLETE.json listing)."""
        if self.cache is None:
            raise ValueError("RemoteWeights needs a cache folder to download into")
        sub = version_name(version)
        complete = self.folders.complete(sub)
        if complete is None:
            raise WeightsError(f"{self.store.uri}/{self.folders.name(sub)} is not published (no {COMPLETE}: "
                               f"an upload in progress or killed)")
        return self.cache / f"{sub}-{hashlib.sha256(complete).hexdigest()[:12]}", json.loads(complete)

    def fetch(self, version: int) -> Path:
        """The cache folder of `version`, downloaded and verified if it is not there yet.

        The folder is named after the version and a digest of its COMPLETE.json, so a version that a
        resumed trainer withdrew and published again with other weights is downloaded again, never
        served from the cache of the first publication."""
        final, listing = self._cached(version)
        if final.is_dir():
            return final
        tmp = self.cache / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{final.name}"
        tmp.mkdir(parents=True)
        try:
            self.folders.download(version_name(version), listing, tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():     # another process of this machine was first: use its copy
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.prune_cache(keep=final)
        return final

    def prune_cache(self, *, keep: Path | None = None) -> list[Path]:
        """Keep `self.keep` cached folders: `keep` (the one being loaded) and the newest others; returns
        the folders deleted."""
        if self.cache is None or not self.cache.is_dir():
            return []
        cached = []
        for p in self.cache.iterdir():
            m = _CACHED.fullmatch(p.name)
            if m and p.is_dir():
                try:
                    cached.append((int(m.group(1)), p.stat().st_mtime, p))
                except FileNotFoundError:
                    pass     # pruned by another process meanwhile
        others = [p for _, _, p in sorted(cached) if p != keep]
        room = self.keep - 1 if keep is not None and keep.is_dir() else self.keep
        doomed = others[:max(0, len(others) - room)]
        for p in doomed:
            gone = self.cache / "tmp" / f"deleting-{uuid.uuid4().hex[:8]}-{p.name}"
            gone.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(p, gone)   # out of sight at once, then deleted
            except FileNotFoundError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
        return doomed

    def verify_cached(self, version: int) -> bool:
        """Whether the cached copy of `version` as now published matches its COMPLETE.json (sizes, SHA-256)."""
        final, listing = self._cached(version)
        return all((final / n).is_file() and (final / n).stat().st_size == size and _sha256(final / n) == sha
                   for n, (size, sha) in listing.items())


class WeightCache:
    """The reading side of WeightStore (latest, folder, is_complete) for a run on an object store:
    what generators and evaluation use. folder(v) is v's verified download in the local cache."""

    def __init__(self, remote: RemoteWeights):
        self.remote = remote
        self.root = f"{remote.store.uri}/{remote.folder}"

    def latest(self) -> int | None:
        return self.remote.latest()

    def is_complete(self, version: int) -> bool:
        return self.remote.is_complete(version)

    def folder(self, version: int) -> Path:
        """The cached copy of `version`, downloaded now if need be; a path that does not exist when the
        version is not (or no longer) published, so a loader fails as it would on a pruned local folder."""
        try:
            return self.remote.fetch(version)
        except (WeightsError, FileNotFoundError):
            return self.remote.cache / "tmp" / f"missing-{version_name(version)}"   # never a folder


class MirroredWeightStore(WeightStore):
    """The trainer's weights for a run on an object store: published into a local folder exactly as
    for a local run (WeightStore), and each version then uploaded (RemoteWeights), LATEST with it."""

    def __init__(self, local_root: str | os.PathLike, remote: RemoteWeights, *, source=None):
        super().__init__(local_root, source=source)
        self.remote = remote

    def publish(self, model, tokenizer, version: int, *, info: dict | None = None) -> Path:
        final = super().publish(model, tokenizer, version, info=info)
        self.remote.upload(final, version)
        return final

    def set_latest(self, version: int) -> None:
        super().set_latest(version)
        if getattr(self, "remote", None) is not None:     # WeightStore.publish calls it before the upload
            if self.remote.is_complete(version):
                self.remote.set_latest(version)

    def prune(self, keep: int) -> list[int]:
        self.remote.prune(keep)
        return super().prune(keep)

    def abandon_after(self, version: int) -> list[int]:
        self.remote.abandon_after(version)
        return super().abandon_after(version)

    def restore(self, version: int) -> bool:
        """Download `version` from the store into the local folder if it is complete there and missing
        here (a trainer resuming on another machine: publishing it again would write other files, as
        weights.json records when it was published); whether it did."""
        sub = version_name(version)
        complete = self.remote.folders.complete(sub)
        if self.folder(version).exists() or complete is None:
            return False
        self.tmp.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp / f"{os.getpid()}%{uuid.uuid4().hex[:8]}%{sub}"
        tmp.mkdir()
        try:
            self.remote.folders.download(sub, json.loads(complete), tmp)
            os.replace(tmp, self.folder(version))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(self.root)
        return True

    def sync(self, version: int) -> None:
        """Upload `version` if the store lacks it (a trainer killed between its local publication and the
        upload), and make it LATEST there."""
        if not self.remote.is_complete(version) and self.is_complete(version):
            self.remote.upload(self.folder(version), version)
        self.remote.set_latest(version)


def open_weights(run, *, cache: str | os.PathLike | None = None):
    """What a generator reads weights through: WeightStore(run/weights) for a local run, a WeightCache
    (downloads into `cache`, default: a folder under ~/.cache/asyncgrpo) for a run on an object store."""
    from buffer.store import RemotePath

    if not isinstance(run, RemotePath):
        return WeightStore(Path(run) / "weights")
    return WeightCache(RemoteWeights(run.store, folder=(run / "weights").key,
                                     cache=cache or work_dir(run) / "weights-cache"))


def work_dir(run) -> Path:
    """This machine's own folder for a run on an object store (checkpoints, the trainer's weights before
    upload, downloaded weights, logs): $ASYNCGRPO_WORK, or ~/.cache/asyncgrpo/work, then <run's URL
    as a folder name>. A local run's is the run directory itself."""
    from buffer.store import RemotePath

    if not isinstance(run, RemotePath):
        return Path(run)
    base = Path(os.environ.get("ASYNCGRPO_WORK") or Path.home() / ".cache" / "asyncgrpo" / "work")
    name = str(run).replace("://", "/").strip("/").replace("/", "__")
    return base / name
