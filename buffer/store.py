"""Where a run's files live: a local folder or an object store (s3://, gs://, az://), behind the
few operations the buffer needs. The foundation of runs on object storage (issue 18).

Every file the pipeline writes is already write-once and published whole; what a local run
gets from POSIX beyond that (a rename that replaces, a lock, a consistent listing) is mapped
here onto what object stores guarantee:

    put_new(name, data)   create-if-absent, whole: True if this call created it, False if it
                          existed. Local: a temp file, fsynced, then os.link (which fails if the
                          name exists). Object store: one PUT with `If-None-Match: *`.
    publish(name, data)   a new, unique name appears whole (the writer owns the name). Local:
                          temp + rename. Object store: one PUT (readers never see a partial one).
    read, list, delete    as they say; S3, GCS and Azure listings are strongly consistent.

On top of put_new, `Numbered` keeps a small state (a manifest, LATEST, the trainer's lease) as
immutable numbered objects where the newest wins: to change it, a writer reads the newest,
number n, and creates n + 1 with put_new; of two writers racing, exactly one creates n + 1
and the other reads again. Nothing is ever overwritten, so no reader sees a half-written state,
and no lock server is needed. `Lease` builds the single-holder rule (one trainer per run) on it.

Credentials and endpoints come from the standard environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_PROFILE, ...; for gs://, STORAGE_EMULATOR_HOST and Google's application
default credentials: buffer/store_gcs.py), never from our config files. Transient failures
(connection refused, 5xx, throttling) are retried with backoff for up to `retry_s` seconds;
`check()` turns a missing bucket, rejected credentials or an unreachable endpoint into one
StoreError that says which.
"""

from __future__ import annotations

import email.utils
import errno
import io
import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from buffer.atomic import BufferError, StorageError, atomic_file, fsync_dir, pid_alive, tmp_name

log = logging.getLogger(__name__)

T = TypeVar("T")
REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs")
DEFAULT_RETRY_S = float(os.environ.get("ASYNCGRPO_STORE_RETRY_S", "60"))
"""How long a store operation is retried while the endpoint is unreachable or failing (seconds):
$ASYNCGRPO_STORE_RETRY_S, default 60. After that it fails with a StoreError naming the endpoint."""


class StoreError(BufferError):
    """A store a user must fix (no bucket, bad credentials, unreachable endpoint); names the URI."""


@dataclass(frozen=True)
class Entry:
    name: str       # relative to the listed folder
    size: int
    mtime: float    # when it was written, by the store's clock (seconds since the epoch)


def is_remote(uri: str | os.PathLike) -> bool:
    return isinstance(uri, str) and uri.split("://", 1)[0] in REMOTE_SCHEMES and "://" in uri


def open_store(uri: str | os.PathLike, *, retry_s: float = DEFAULT_RETRY_S) -> "Store":
    """A Store for a local folder or an s3:// (gs://, az://) URI. Nothing is checked or created yet."""
    if is_remote(uri):
        return remote_store(str(uri), retry_s=retry_s)
    return LocalStore(Path(uri))


def remote_store(uri: str, *, retry_s: float = DEFAULT_RETRY_S) -> "FsspecStore":
    """The FsspecStore for `uri`'s scheme: GcsStore for gs:// (gcs://), AzureStore for az:// (abfs://),
    the S3 one otherwise."""
    scheme = uri.split("://", 1)[0]
    if scheme in ("gs", "gcs"):
        from buffer.store_gcs import GcsStore
        return GcsStore(uri, retry_s=retry_s)
    if scheme in ("az", "abfs"):
        from buffer.store_az import AzureStore
        return AzureStore(uri, retry_s=retry_s)
    return FsspecStore(uri, retry_s=retry_s)


class Store:
    """Write-once objects under one root; names are '/'-separated, relative to the root."""

    uri: str

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def list(self, folder: str = "") -> list[Entry]:
        """The objects directly in `folder` (not in its subfolders), sorted by name; [] if none."""
        raise NotImplementedError

    def list_folders(self, folder: str = "") -> list[str]:
        """The names of the subfolders directly in `folder` (prefixes holding objects), sorted; [] if none."""
        raise NotImplementedError

    def put_new(self, name: str, data: bytes) -> bool:
        raise NotImplementedError

    def publish(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove `name`; a missing one is fine."""
        raise NotImplementedError

    def upload(self, name: str, local: Path) -> None:
        """publish() of a local file's bytes, streamed (a multipart upload appears whole when complete)."""
        raise NotImplementedError

    def download(self, name: str, local: Path) -> None:
        """Copy object `name` to the local file `local` (streamed)."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise StoreError unless the root can be listed and written (run before starting daemons)."""
        raise NotImplementedError

    def now(self) -> float:
        """The store's clock (seconds since the epoch): what the times of `list` entries are measured by."""
        return time.time()

    def url(self, name: str) -> str:
        """What DuckDB and pyarrow are given for `name` (with `arrow_filesystem()` / `register()`)."""
        raise NotImplementedError

    def arrow_filesystem(self):
        """A pyarrow filesystem that reads `url(name)`."""
        raise NotImplementedError

    def register(self, con) -> None:
        """Let DuckDB connection `con` read `url(name)`: no extension is downloaded."""


class LocalStore(Store):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / name

    def read(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def list(self, folder: str = "") -> list[Entry]:
        out = []
        try:
            with os.scandir(self._path(folder)) as it:
                for e in it:
                    try:
                        if e.is_file() and not e.name.endswith(".tmp"):
                            st = e.stat()
                            out.append(Entry(e.name, st.st_size, st.st_mtime))
                    except FileNotFoundError:
                        pass        # deleted while listed
        except FileNotFoundError:
            return []
        return sorted(out, key=lambda e: e.name)

    def list_folders(self, folder: str = "") -> list[str]:
        try:
            with os.scandir(self._path(folder)) as it:
                return sorted(e.name for e in it if e.is_dir())
        except FileNotFoundError:
            return []

    def _tmp_write(self, final: Path, data: bytes) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / tmp_name(final.name)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StorageError(final, e) from e
        return tmp

    def put_new(self, name: str, data: bytes) -> bool:
        final = self._path(name)
        tmp = self._tmp_write(final, data)
        try:
            os.link(tmp, final)          # atomic, and fails if `final` exists: create-if-absent
        except FileExistsError:
            return False
        except OSError as e:
            raise StorageError(final, e) from e
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)
        return True

    def publish(self, name: str, data: bytes) -> None:
        final = self._path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(final.parent, final) as f:
            f.write(data)

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def upload(self, name: str, local: Path) -> None:
        final = self._path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "rb") as src, atomic_file(final.parent, final) as f:
            shutil.copyfileobj(src, f, 1 << 20)

    def download(self, name: str, local: Path) -> None:
        shutil.copyfile(self._path(name), local)

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} is not a folder")

    def url(self, name: str) -> str:
        return str(self._path(name))

    def arrow_filesystem(self):
        import pyarrow.fs as pafs
        return pafs.LocalFileSystem()


_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "ConditionalRequestConflict",
                    "ServerBusy", "OperationTimedOut"}


def error_code(e: BaseException) -> tuple[str | None, int | None]:
    """(S3 error code, HTTP status) of a botocore ClientError behind `e` (s3fs wraps them), or (None,
    HTTP status) of a gcsfs HttpError, or (error code, HTTP status) of an Azure HttpResponseError, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            return err.get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if type(e).__name__ == "HttpError" and isinstance(getattr(e, "code", None), int):
            return None, e.code
        if isinstance(getattr(e, "status_code", None), int) and hasattr(e, "error_code"):   # azure.core's
            code = e.error_code
            return (None if code is None else str(getattr(code, "value", code))), e.status_code
        e = e.__cause__ or e.__context__
    return None, None


def _transient(e: BaseException) -> bool:
    """Whether `e` may pass if tried again: the endpoint down or slow, throttling, a 5xx. Judged by the
    exception's type and the S3 error code, never by the message (which holds bucket and key names)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, StoreError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if type(e).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                            "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
                            "ConnectionClosedError", "ServerTimeoutError", "ClientPayloadError",
                            "ProxyError", "ChunkedEncodingError", "ServiceRequestError", "ServiceResponseError",
                            "ServiceRequestTimeoutError", "ServiceResponseTimeoutError", "IncompleteReadError"):
        return True
    code, status = error_code(e)
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status in (408, 429))):
        return True
    if isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE):
        return True
    cause = e.__cause__ or e.__context__
    return cause is not None and cause is not e and _transient(cause)


def _no_such_bucket(e: BaseException) -> bool:
    code, _ = error_code(e)
    return code == "NoSuchBucket" or "The specified bucket does not exist" in str(e)


def _mtime(info: dict) -> float:
    t = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or 0.0
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


class FsspecStore(Store):
    """An object store through fsspec (s3fs for s3://). Writes are single PUTs of whole objects.

    What differs between stores (the filesystem, the endpoint's variable, the conditional writes, how a
    missing bucket shows) is in the methods a subclass overrides: GcsStore (buffer/store_gcs.py)."""

    ENDPOINT_VAR = "AWS_ENDPOINT_URL"
    CREDENTIALS_HINT = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
    EXTRA = "s3"
    BUCKET = "bucket"      # what the store calls one (Azure: a container)

    def __init__(self, uri: str, *, retry_s: float = DEFAULT_RETRY_S):
        self.uri = uri.rstrip("/")
        self.scheme, rest = self.uri.split("://", 1)
        self.root = rest
        self.bucket = rest.split("/", 1)[0]
        self.retry_s = retry_s
        try:
            self.fs = self._make_fs()
        except ImportError as e:
            raise StoreError(f"{self.uri}: cannot use {self.scheme}:// ({e}); install it: "
                             f"pip install -e '.[{self.EXTRA}]'") from e

    def _make_fs(self):
        import fsspec

        # Few retries inside s3fs and botocore: `_retry` owns the backoff, so retry_s bounds the wait.
        opts = ({"config_kwargs": {"connect_timeout": 5, "read_timeout": 15,
                                   "retries": {"max_attempts": 2, "mode": "standard"}}}
                if self.scheme == "s3" else {})
        fs = fsspec.filesystem(self.scheme, skip_instance_cache=True, **opts)
        if self.scheme == "s3":
            fs.retries = 2
        return fs

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def endpoint(self) -> str:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"

    def _bucket_missing(self, e: BaseException) -> bool:
        """Whether `e` says that the bucket does not exist (S3 names it: NoSuchBucket)."""
        return _no_such_bucket(e)

    def _absent(self, e: BaseException, value=None):
        """`value` for a not-found error `e` (the object is absent), unless it is the bucket that is
        missing: that is the store's error, raised again."""
        if self._bucket_missing(e):
            raise e
        return value

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """fn(), tried again with backoff (0.2 s doubling to 5 s) while it fails transiently, up to retry_s."""
        deadline, delay, warned = time.monotonic() + self.retry_s, 0.2, False
        while True:
            try:
                return fn()
            except StoreError:
                raise
            except Exception as e:
                if not _transient(e):
                    if self._misconfigured(e):     # no bucket, bad credentials: one clear error
                        raise StoreError(self._explain(e)) from e
                    raise
                if time.monotonic() + delay > deadline:
                    raise StoreError(self._explain(e) + f" (retried for {self.retry_s:.0f} s)") from e
                if not warned:
                    log.warning("%s %s/%s failed (%s: %s); retrying for up to %.0f s", what, self.uri, "",
                                type(e).__name__, e, self.retry_s)
                    warned = True
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)

    def read(self, name: str) -> bytes:
        def get():
            # s3fs sizes the object from its listing cache: an object created after this instance listed
            # its folder would read as missing
            self.fs.invalidate_cache(self._key(name))
            return self.fs.cat_file(self._key(name))
        return self._retry("read", get)

    def _ls(self, folder: str) -> list[dict]:
        """fs.ls of `folder` from the store itself (no listing cache), with retries; [] if it is empty."""
        key = self._key(folder)

        def ls():
            self.fs.invalidate_cache(key)
            try:
                return self.fs.ls(key, detail=True, refresh=True)
            except FileNotFoundError as e:
                return self._absent(e, [])
        return self._retry("list", ls)

    def list(self, folder: str = "") -> list[Entry]:
        return sorted((Entry(i["name"].rsplit("/", 1)[-1], int(i.get("size") or 0), _mtime(i))
                       for i in self._ls(folder) if i.get("type") == "file"), key=lambda e: e.name)

    def list_folders(self, folder: str = "") -> list[str]:
        return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in self._ls(folder)
                      if i.get("type") == "directory")

    def put_new(self, name: str, data: bytes) -> bool:
        def put():
            try:
                self.fs.pipe_file(self._key(name), data, mode="create")
                return True
            except FileExistsError:
                # Also what a retried PUT whose first try succeeded (its answer lost) gets: the object holds
                # exactly these bytes then. Callers make their bytes their own (a nonce, pid and time), or
                # write bytes that any writer may equally have written (COMPLETE.json).
                try:
                    return self.fs.cat_file(self._key(name)) == data
                except FileNotFoundError:
                    return False
        return self._retry("put", put)

    def publish(self, name: str, data: bytes) -> None:
        self._retry("put", lambda: self.fs.pipe_file(self._key(name), data))

    def delete(self, name: str) -> None:
        def rm():
            try:
                self.fs.rm_file(self._key(name))
            except FileNotFoundError:
                pass
        self._retry("delete", rm)

    def upload(self, name: str, local: Path) -> None:
        """One PUT for a file under two parts, else a multipart upload (S3: parts of
        $ASYNCGRPO_STORE_PART_MB MiB, default 50 as s3fs's, at least 5, S3's smallest part). Either way
        the object appears only whole; a process killed inside a multipart upload leaves its parts
        stored (and billed) under no name, until `abort_incomplete_uploads` (the compactor's hourly
        housekeeping) removes them."""
        kw = {}
        if self.scheme == "s3":
            raw = os.environ.get("ASYNCGRPO_STORE_PART_MB", "50")
            try:
                part_mb = float(raw)
            except ValueError:
                part_mb = -1.0
            if not part_mb >= 5:
                raise StoreError(f"ASYNCGRPO_STORE_PART_MB={raw!r}: must be a number of MiB >= 5 "
                                 f"(S3's smallest part)")
            # S3 takes at most 10,000 parts: a larger file gets larger parts.
            kw["chunksize"] = max(int(part_mb * 2**20), -(-local.stat().st_size // 10_000))
        self._retry("upload", lambda: self.fs.put_file(str(local), self._key(name), **kw))

    def abort_incomplete_uploads(self, older_than_s: float) -> list[str]:
        """Abort the multipart uploads under this root started at least `older_than_s` ago (both times by
        the store's clock) and never completed: a process killed inside `upload`. Returns their keys. One
        in progress is younger than that: a bound of hours spares it."""
        if self.scheme != "s3":
            return []
        prefix = self.root.split("/", 1)[1] + "/" if "/" in self.root else ""
        query, aborted, now = {"Bucket": self.bucket, "Prefix": prefix}, [], self.now()
        while True:
            page = self._retry("list", lambda: self.fs.call_s3("list_multipart_uploads", **query))
            for u in page.get("Uploads", []):
                if now - _mtime({"LastModified": u["Initiated"]}) < older_than_s:
                    continue
                try:
                    self._retry("abort", lambda u=u: self.fs.call_s3(
                        "abort_multipart_upload", Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]))
                except FileNotFoundError:
                    continue        # completed or aborted by another process meanwhile
                aborted.append(u["Key"])
            if not page.get("IsTruncated"):
                return aborted
            query.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page["NextUploadIdMarker"])

    def download(self, name: str, local: Path) -> None:
        self._retry("download", lambda: self.fs.get_file(self._key(name), str(local)))

    # -- replace-if-unchanged (S3's If-Match): the manifests -----------------------------
    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """(content, ETag) of `name`, None if absent. The ETag is read first: if the object changes
        between the two reads, the ETag is the older one and a replace_if with it fails (safe)."""
        bucket, key = self._key(name).split("/", 1)

        def get():
            try:
                etag = self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
                return self.fs.cat_file(self._key(name)), etag
            except FileNotFoundError:
                return None
        return self._retry("read", get)

    def replace_if(self, name: str, data: bytes, etag: str | None) -> str | None:
        """PUT `data` only if `name` still has ETag `etag` (None: only if it does not exist); the new
        ETag, or None when another writer changed it first (nothing written)."""
        bucket, key = self._key(name).split("/", 1)
        cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}

        def put():
            try:
                return self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)["ETag"]
            except (FileExistsError, FileNotFoundError):
                return None     # 412 (s3fs: FileExistsError), or If-Match on an object deleted meanwhile
            except Exception as e:
                if any(t in str(e) for t in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")):
                    return None
                raise
        out = self._retry("put", put)
        self.fs.invalidate_cache(self._key(name))
        return out

    def now(self) -> float:
        """The server's clock, from the Date header of a one-key listing under this root (1 s resolution,
        as the LastModified times it is compared with; a listing under the prefix is what credentials
        scoped to the run's prefix allow, unlike a HEAD of the bucket); this machine's clock where the
        filesystem has no S3 call."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return time.time()
        prefix = self.root.split("/", 1)[1] + "/" if "/" in self.root else ""

        def ask():
            got = call("list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
            date = got.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            return email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
        return self._retry("read", ask)

    def check(self) -> None:
        probe = f".check-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.ls(self.bucket, refresh=True)
            self.fs.pipe_file(self._key(probe), b"", mode="create")
            self.fs.rm_file(self._key(probe))
        except Exception as e:
            raise StoreError(self._explain(e)) from e

    def _misconfigured(self, e: Exception) -> bool:
        """No bucket, or credentials refused (judged by the error code or type, not by key names)."""
        code, status = error_code(e)
        return (isinstance(e, PermissionError) or self._bucket_missing(e) or status == 403
                or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                            "InvalidToken") or type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"))

    def _explain(self, e: Exception) -> str:
        text = f"{type(e).__name__}: {e}"
        low = text.lower()
        if self._bucket_missing(e):
            return (f"{self.uri}: the {self.BUCKET} {self.bucket!r} does not exist at {self.endpoint()} ({e}); "
                    f"create it first")
        if self._misconfigured(e) or "credential" in low:
            return (f"{self.uri}: the credentials were rejected at {self.endpoint()} ({text}); set "
                    f"{self.CREDENTIALS_HINT} for this bucket")
        if _transient(e) or "connect" in low or "endpoint" in low:
            return (f"{self.uri}: cannot reach the endpoint {self.endpoint()} ({text}); check {self.ENDPOINT_VAR} "
                    f"and that the server is up")
        return f"{self.uri}: {text}"

    def url(self, name: str) -> str:
        return f"{self.scheme}://{self._key(name)}"

    def arrow_filesystem(self):
        import pyarrow.fs as pafs
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))

    def register(self, con) -> None:
        con.register_filesystem(self.fs)


# -- immutable numbered objects: the compare-and-swap of object stores -------------------------

class Conflict(BufferError):
    """Another writer created the next number first; read again and retry."""


_NONCE = "_writer_nonce"


class Numbered:
    """A small JSON state kept as `folder/stem-<n>.json`, n = 1, 2, ...; the newest is the state.

    `update(fn)` reads the newest (n, state), computes fn(state) and creates n + 1 with put_new;
    if another writer created n + 1 first, it reads again and retries. A reader lists, then reads
    the highest number; one deleted in between is read again from a fresh listing.

    Old numbers are deleted once `keep` newer ones exist and the newest is `grace_s` younger than
    them (both times by the store's clock). A writer whose read is older than grace_s / 2 by the time
    it would create n + 1 reads again, so it can never re-create a number already deleted (which
    would go unseen: not the newest) and lose its update. The same assumption as the buffer's
    compaction grace: no process pauses for grace_s / 2 between two of its own lines.
    """

    def __init__(self, store: Store, folder: str, stem: str, *, keep: int = 8, grace_s: float = 300.0):
        self.store, self.folder, self.stem = store, folder.strip("/"), stem
        self.keep, self.grace_s = keep, grace_s

    def _name(self, n: int) -> str:
        return f"{self.folder}/{self.stem}-{n:012d}.json"

    def _numbers(self) -> list[tuple[int, float]]:
        out = []
        for e in self.store.list(self.folder):
            head, _, tail = e.name.removesuffix(".json").rpartition("-")
            if head == self.stem and e.name.endswith(".json") and tail.isdigit():
                out.append((int(tail), e.mtime))
        return sorted(out)

    def read(self) -> tuple[int, dict | None]:
        """(n, state) of the newest; (0, None) when there is none."""
        n, state, _ = self.read_timed()
        return n, state

    def read_timed(self) -> tuple[int, dict | None, float]:
        """(n, state, when it was written by the store's clock) of the newest; (0, None, 0.0) if none."""
        for _ in range(10):
            numbers = self._numbers()
            if not numbers:
                return 0, None, 0.0
            n, written = numbers[-1]
            try:
                raw = self.store.read(self._name(n))
            except FileNotFoundError:
                continue    # pruned between the listing and the read: list again
            try:
                state = json.loads(raw)
                state.pop(_NONCE, None)
                return n, state, written
            except ValueError as e:
                raise BufferError(f"unreadable {self.store.uri}/{self._name(n)}: {e}") from e
        raise BufferError(f"{self.store.uri}/{self.folder}: {self.stem} kept changing while being read")

    def create(self, n: int, state: dict) -> bool:
        """Make `state` number n; False if n exists (another writer was first)."""
        # A nonce makes each writer's bytes its own: put_new tells a retried PUT of ours (same bytes)
        # from another writer's equal state (which must count as a conflict).
        data = json.dumps({**state, _NONCE: uuid.uuid4().hex}, sort_keys=True).encode()
        ok = self.store.put_new(self._name(n), data)
        if ok and n > self.keep:
            self.prune()
        return ok

    def update(self, fn: Callable[..., dict | None], *, attempts: int = 100,
               timed: bool = False) -> tuple[int, dict | None]:
        """Apply fn to the newest state until this writer's n + 1 is the one created; (n, state) written.
        fn returning None leaves the state as it is (nothing written). timed: fn(state, written), with
        `written` the time the state was written by the store's clock (0.0 when there is none)."""
        for _ in range(attempts):
            started = time.monotonic()
            n, state, written = self.read_timed()
            new = fn(state, written) if timed else fn(state)
            if new is None:
                return n, state
            if time.monotonic() - started > self.grace_s / 2:
                continue        # read too long ago: n + 1 may be an old number already pruned
            if self.create(n + 1, new):
                return n + 1, new
            time.sleep(random.random() * 0.05)
        raise Conflict(f"{self.store.uri}/{self.folder}: {attempts} writers were first at {self.stem}; giving up")

    def prune(self) -> int:
        """Delete the numbers that `keep` newer ones and `grace_s` of age allow; how many."""
        numbers = self._numbers()
        if len(numbers) <= self.keep:
            return 0
        newest_n, newest_t = numbers[-1]
        old = [n for n, t in numbers if n <= newest_n - self.keep and newest_t - t >= self.grace_s]
        for n in old:
            self.store.delete(self._name(n))
        return len(old)


class LeaseHeld(BufferError):
    """Another process holds the lease; the message names it."""


def host_id() -> str:
    """This machine and pid namespace: the host name, the boot id and the pid namespace's inode (two
    containers of one host share a host name, not a pid namespace)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, ns = "", 0
    return f"{os.uname().nodename}/{boot}/{ns}"


def _dead_here(state: dict) -> bool:
    """Whether a lease's holder was a process of this host (and pid namespace) that is gone (killed):
    free at once, as a local lock file's would be."""
    return state.get("host_id") == host_id() and not pid_alive(int(state.get("pid", -1)))


class Lease:
    """One holder of a role at a time (the trainer of a run), on any store.

    The lease is a Numbered state {holder, host, pid, ttl_s}. `acquire` takes it when there is none,
    the current one expired (its holder stopped renewing: killed elsewhere), or its holder was a process
    of this host that is gone (killed here: no need to wait), by creating the next number:
    of two racing, one wins. `renew` extends it (the holder's own next number); a holder whose renew
    finds someone else's newer lease has lost it and must stop (fencing: `LeaseHeld`).

    Expiry is judged by the store's clock alone: a state expires ttl_s after the store wrote it
    (its LastModified), compared with the store's time now (`Store.now`), plus a second for their
    1 s resolution. The machines' clocks never meet, so a skewed clock cannot take a live lease.
    """

    def __init__(self, store: Store, folder: str, role: str, *, ttl_s: float = 30.0):
        self.numbered = Numbered(store, folder, role, grace_s=max(60.0, 4 * ttl_s))
        self.role, self.ttl_s = role, ttl_s
        self.holder = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.epoch: int | None = None

    def _mine(self) -> dict:
        return {"holder": self.holder, "host": os.uname().nodename, "host_id": host_id(), "pid": os.getpid(),
                "ttl_s": self.ttl_s}

    def acquire(self) -> None:
        def take(state, written):
            if state is None or state["holder"] == self.holder or state.get("released") or _dead_here(state):
                return self._mine()
            left = written + float(state.get("ttl_s", self.ttl_s)) + 1.0 - self.numbered.store.now()
            if left > 0:
                raise LeaseHeld(f"{self.numbered.store.uri}: another {self.role} holds this run "
                                f"(pid {state['pid']} on {state['host']}, lease valid for "
                                f"{left:.0f} s more); stop it first, or wait until its lease "
                                f"expires if it was killed")
            return self._mine()
        self.epoch, _ = self.numbered.update(take, timed=True)

    def renew(self) -> None:
        n, state = self.numbered.read()
        if state is None or state["holder"] != self.holder:
            raise LeaseHeld(f"{self.numbered.store.uri}: this {self.role} lost its lease to "
                            f"{state and state['holder']}; stopping")
        if not self.numbered.create(n + 1, self._mine()):
            raise LeaseHeld(f"{self.numbered.store.uri}: this {self.role} lost its lease while renewing; stopping")
        self.epoch = n + 1

    def release(self) -> None:
        def drop(state):
            if state is None or state["holder"] != self.holder:
                return None
            return {**state, "released": True}
        self.numbered.update(drop)


# -- paths on a store: what the buffer's code uses of pathlib.Path ----------------------------

class RemotePath:
    """A file or folder on an object store with the few pathlib.Path methods the buffer uses, so
    one code path serves a local run (pathlib.Path) and a remote one. Folders do not exist on
    object stores: mkdir does nothing, and a folder exists when something is under it."""

    def __init__(self, store: "FsspecStore", key: str, entry: Entry | None = None):
        self.store, self.key = store, key.strip("/")
        self.entry = entry   # size and time from the listing that found it: stat() needs no request

    # -- names ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name

    @property
    def suffix(self) -> str:
        return "." + self.name.rsplit(".", 1)[1] if "." in self.name else ""

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.store, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def with_name(self, name: str) -> "RemotePath":
        return self.parent / name

    def __truediv__(self, other) -> "RemotePath":
        return RemotePath(self.store, f"{self.key}/{other}" if self.key else str(other))

    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other) -> bool:   # by URL: the same object reached from two roots is equal
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: "RemotePath") -> bool:
        return str(self) < str(other)

    def absolute(self) -> "RemotePath":
        return self

    # -- what is there -----------------------------------------------------------
    def iterdir(self):
        return (RemotePath(self.store, f"{self.key}/{e.name}", e) for e in self.store.list(self.key))

    def glob(self, pattern: str):
        import fnmatch
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def _info(self) -> dict | None:
        """The object's metadata (one HEAD), None when there is none."""
        key = self.store._key(self.key)

        def head():
            self.store.fs.invalidate_cache(key)
            try:
                return self.store.fs.info(key)
            except FileNotFoundError as e:
                return self.store._absent(e)   # a missing bucket is the store's error, not a missing file
        return self.store._retry("stat", head)

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        def ls():
            try:
                return bool(self.store.fs.ls(self.store._key(self.key), refresh=True))
            except FileNotFoundError:
                return False
        return self.store._retry("list", ls)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def stat(self):
        """Size and time (st_ino 0: names are never reused); from the listing that found it, if one did."""
        from types import SimpleNamespace
        e = self.entry
        if e is None:
            info = self._info()
            if info is None or info.get("type") != "file":
                raise FileNotFoundError(str(self))
            e = Entry(self.name, int(info.get("size") or 0), _mtime(info))
        return SimpleNamespace(st_size=e.size, st_mtime=e.mtime, st_mtime_ns=int(e.mtime * 1e9), st_ino=0)

    # -- reading and writing -----------------------------------------------------
    def read_bytes(self) -> bytes:
        return self.store.read(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.store.publish(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(str(self))
        self.store.delete(self.key)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass

    # -- for pyarrow and DuckDB ---------------------------------------------------
    def arrow(self) -> tuple[str, object]:
        """(path, filesystem) for pyarrow's readers."""
        return self.store._key(self.key), self.store.fs


def store_path(root: str | os.PathLike, *, retry_s: float = DEFAULT_RETRY_S):
    """A pathlib.Path for a local folder, a RemotePath for an s3:// (gs://, az://) URI."""
    if is_remote(root):
        return RemotePath(remote_store(str(root), retry_s=retry_s), "")
    return Path(root)


def arrow_source(path) -> tuple[object, object | None]:
    """(source, filesystem) for pq.ParquetFile / read_table / read_metadata, for either kind of path."""
    return path.arrow() if isinstance(path, RemotePath) else (path, None)


class RetryingFile(io.RawIOBase):
    """A read-only file over one object whose every read is retried like the store's own calls (the
    endpoint down a while, a connection reset), reopening the object where the last read stopped.
    What pyarrow's Parquet readers read remote shards through, so an outage delays a read rather than
    making a healthy shard look unreadable. Each read is one ranged GET (pyarrow reads a footer, then
    whole column chunks). A missing object is FileNotFoundError, as locally."""

    def __init__(self, path: "RemotePath"):
        super().__init__()
        self.path, self.pos = path, 0
        self._key = path.store._key(path.key)
        self.size = path.stat().st_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, max(self.size - self.pos, 0))
        if n <= 0:
            return b""

        start = self.pos
        data = self.path.store._retry("read", lambda: self.path.store.fs.cat_file(self._key, start=start,
                                                                                 end=start + n))
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)


def parquet_file(path, **kw):
    import pyarrow.parquet as pq
    if isinstance(path, RemotePath):
        return pq.ParquetFile(RetryingFile(path), **kw)
    return pq.ParquetFile(path, **kw)


def read_table(path, **kw):
    import pyarrow.parquet as pq
    if isinstance(path, RemotePath):
        return pq.read_table(RetryingFile(path), **kw)
    return pq.read_table(path, **kw)


def read_metadata(path):
    import pyarrow.parquet as pq
    if isinstance(path, RemotePath):
        return pq.read_metadata(RetryingFile(path))
    return pq.read_metadata(path)


def list_entries(folder) -> dict[str, Entry | None]:
    """list_names with each remote file's Entry (None for a local file: stat() it)."""
    if isinstance(folder, RemotePath):
        return {e.name: e for e in folder.store.list(folder.key)}
    return dict.fromkeys(os.listdir(folder))


def list_names(folder) -> list[str]:
    """Names of the files directly in `folder` (a Path or RemotePath); FileNotFoundError if it is missing
    (a local folder) — a remote folder with nothing in it is empty."""
    return list(list_entries(folder))


class LeaseLock:
    """filelock.FileLock's interface (acquire(timeout), release, is_locked, `with`, re-entrant) on a
    store, built on `Lease`: acquiring waits while another process holds it, a thread renews it every
    ttl_s / 3 while held, and a holder killed with -9 frees it `ttl_s` later (at once on its own host).

    A holder can lose the lease while it runs (paused, or the store unreachable for longer than the
    lease): `assert_held()` raises LeaseHeld once the last successful renewal is older than the lease,
    and the buffer calls it before each write only one holder may make (a ledger record); manifests
    are also written with If-Match (FileSet), so a lapsed holder cannot overwrite them. A renewal
    still in flight when the window closes (slow, or retrying while the store is briefly down)
    decides: `assert_held()` waits for its outcome rather than give up a lease that may still be ours."""

    def __init__(self, path: RemotePath, *, ttl_s: float = 30.0, poll_s: float = 0.25):
        self.path, self.ttl_s, self.poll_s = path, ttl_s, poll_s
        self._lease = Lease(path.store, path.key, "lock", ttl_s=ttl_s)
        self._count = 0
        self._guard = threading.RLock()       # acquire / release
        self._renewing = threading.Lock()     # one renewal or release at a time
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._valid_until = 0.0               # monotonic: the lease is surely ours until then

    @property
    def is_locked(self) -> bool:
        return self._count > 0

    def assert_held(self) -> None:
        if self._count and time.monotonic() > self._valid_until:
            # A renewal holding `_renewing` (its store calls retrying through an outage) decides: success
            # moves `_valid_until` on from the renewal's start, failure leaves it behind (or at 0). Only
            # the renewal thread and release() take `_renewing`, neither waits for this caller, and the
            # store's retry_s bounds a renewal, so this wait is bounded and cannot deadlock.
            with self._renewing:
                pass
        if self._count and time.monotonic() > self._valid_until:
            raise LeaseHeld(f"{self.path}: the lease of this process lapsed (not renewed for {self.ttl_s:.0f} s: "
                            f"a pause, or the store unreachable); another process may hold it now, so this "
                            f"one stops rather than write")

    def acquire(self, timeout: float = -1, poll_interval: float | None = None):
        from filelock import Timeout

        with self._guard:
            if self._count:
                self._count += 1
                return self
            deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
            while True:
                started = time.monotonic()
                try:
                    self._lease.acquire()
                    break
                except LeaseHeld:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise Timeout(str(self.path)) from None
                    time.sleep(poll_interval or self.poll_s)
            self._valid_until = started + self.ttl_s * 2 / 3
            self._count = 1
            self._start_renewing(started)
            return self

    def _start_renewing(self, started: float) -> None:
        stop = self._stop = threading.Event()

        def renew():
            # Renewals start ttl_s / 3 apart, start to start: one slowed by an outage (retries) must not push
            # the next past the end of the window it opened, where assert_held would find none in flight.
            last = started
            while not stop.wait(max(0.0, last + self.ttl_s / 3 - time.monotonic())):
                last = time.monotonic()
                if not self._renew(stop):
                    return

        self._thread = threading.Thread(target=renew, daemon=True, name=f"lease-{self.path.name}")
        self._thread.start()

    def _renew(self, stop: threading.Event) -> bool:
        """One renewal, the renewal thread's tick; False when renewing ends (released, or the lease lost)."""
        with self._renewing:
            if stop.is_set():
                return False
            started = time.monotonic()
            try:
                self._lease.renew()
                self._valid_until = started + self.ttl_s * 2 / 3
            except LeaseHeld:
                self._valid_until = 0.0
                log.error("lost the lock %s (a renewal came too late); its holder stops at its next write",
                          self.path)
                return False
            except Exception as e:   # the store down a while: try again at the next tick
                log.warning("could not renew the lock %s: %s", self.path, e)
            return True

    def release(self, force: bool = False) -> None:
        with self._guard:
            if not self._count:
                return
            self._count = 0 if force else self._count - 1
            if self._count:
                return
            if self._stop is not None:
                self._stop.set()
            with self._renewing:          # no renewal in flight: it could re-create the lease after this
                self._lease.release()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def store_lock(path):
    """A lock at `path`: filelock.FileLock locally, LeaseLock on an object store."""
    if isinstance(path, RemotePath):
        return LeaseLock(path)
    from filelock import FileLock
    return FileLock(str(path))


def move(src, dst) -> None:
    """os.replace for either kind of path; on an object store a copy, then the delete (FileNotFoundError
    if `src` is gone)."""
    if isinstance(src, RemotePath):
        dst.write_bytes(src.read_bytes())
        src.unlink(missing_ok=True)
    else:
        os.replace(src, dst)


def as_path(path):
    """`path` as the buffer's code uses it: a RemotePath or a pathlib.Path stays as it is; a string or
    os.PathLike becomes one (store_path)."""
    return path if isinstance(path, (Path, RemotePath)) else store_path(path)


def remove_tree(path) -> None:
    """shutil.rmtree for either kind of path (on an object store: every object under the prefix)."""
    if isinstance(path, RemotePath):
        key = path.store._key(path.key)
        path.store._retry("delete", lambda: path.store.fs.rm(key, recursive=True) if path.store.fs.exists(key)
                          else None)
    else:
        shutil.rmtree(path)
