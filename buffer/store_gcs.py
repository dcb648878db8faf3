"""gs:// run directories: the Store on Google Cloud Storage, through gcsfs (issue 18).

Every GCS object has a generation, a number that changes whenever the object is written; a write
can be made conditional on it. The Store's guarantees map onto GCS's JSON API as:

    put_new         one upload with ifGenerationMatch=0: it creates the object only if no live
                    object has the name (412 otherwise). gcsfs's pipe_file(mode="create").
    publish         one upload (multipart: metadata and bytes in one request); appears whole.
    read_versioned  one GET (alt=media): the bytes and, in the x-goog-generation header, their
                    generation (the "ETag" that FileSet keeps).
    replace_if      one multipart upload with ifGenerationMatch=<the generation read> (0 when it
                    did not exist); a 412 means another writer was first: None, nothing written.
    missing bucket  GCS answers 404 for a missing bucket and a missing object alike (gcsfs raises
                    a bare FileNotFoundError); a 404 is the bucket's when listing the bucket is one too.

The endpoint is $STORAGE_EMULATOR_HOST when set (an emulator: no credentials, as Google's client
libraries do there), else Google's; credentials come from Application Default Credentials
(GOOGLE_APPLICATION_CREDENTIALS, gcloud's, the metadata server), never from our config files.

We build gcsfs.core.GCSFileSystem, not `gcsfs.GCSFileSystem` (ExtendedGcsFileSystem by default):
that one asks a gRPC control API for each bucket's type (zonal buckets) before its first write
and, where the API is not there (an emulator), waits 60 s for it. And gcsfs retries each request
6 times with backoff (about 31 s) whatever it is told; here 2 tries, as for S3: `_retry` owns the
backoff, so retry_s bounds the wait. Files opened for DuckDB use the readahead cache, as with s3fs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import types
from urllib.parse import quote

from buffer.store import DEFAULT_RETRY_S, FsspecStore, error_code

_EMULATOR_VAR = "STORAGE_EMULATOR_HOST"


def _emulator() -> str | None:
    """$STORAGE_EMULATOR_HOST as gcsfs reads it ('' and 'default' mean none)."""
    host = os.environ.get(_EMULATOR_VAR, "")
    return None if host in ("", "default") else host


@functools.cache
def _default_credentials():
    """Application Default Credentials as gcsfs finds them (None: none found, anonymous), looked up once
    per process: where there are none, the lookup probes for a GCE metadata server, ~15 s on a machine
    that has none ($NO_GCE_CHECK=true skips the probe), and every store opened would pay it again."""
    from gcsfs.credentials import GoogleCredentials
    return GoogleCredentials(project=None, access="full_control", token=None).credentials


def _token():
    """What GCSFileSystem is given as `token`: anonymous for an emulator (as Google's client libraries
    do), else the process's default credentials."""
    if _emulator():
        return "anon"
    return _default_credentials() or "anon"


class GcsStore(FsspecStore):
    """A run directory on gs://bucket/prefix; see the module doc for how each write maps."""

    ENDPOINT_VAR = _EMULATOR_VAR
    CREDENTIALS_HINT = "GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`)"
    EXTRA = "gcs"

    def __init__(self, uri: str, *, retry_s: float = DEFAULT_RETRY_S):
        self._bucket_seen = False       # a listing of the bucket succeeded once: a 404 is an object's
        super().__init__(uri, retry_s=retry_s)
        self.scheme = "gs"              # gcs:// is an alias; URLs given to DuckDB and pyarrow say gs://

    def _make_fs(self):
        # gcsfs logs each request it gives up on with a traceback (ERROR), and its import at INFO; the
        # store retries and reports failures itself (one StoreError), so only CRITICAL gets through.
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
        import aiohttp
        from gcsfs.core import GCSFileSystem
        from gcsfs.retry import retry_request

        fs = GCSFileSystem(token=_token(), skip_instance_cache=True,
                           requests_timeout=aiohttp.ClientTimeout(sock_connect=5, sock_read=15))
        fs._request = types.MethodType(retry_request(retries=2)(GCSFileSystem._request.__wrapped__), fs)
        open_ = fs._open

        def _open(path, mode="rb", **kw):
            # DuckDB reads a footer, then column chunks: readahead (s3fs's default), not gcsfs's "adaptive"
            # cache, whose background prefetch tasks are left pending (and warned about) when a CLI exits.
            return open_(path, mode, **{"cache_type": "readahead", **kw})
        fs._open = _open
        return fs

    def endpoint(self) -> str:
        return _emulator() or "the default endpoint (storage.googleapis.com)"

    def _bucket_missing(self, e: BaseException) -> bool:
        """A 404 is the bucket's when listing the bucket is a 404 too (asked once per store, until the
        bucket is seen); a listing that fails otherwise (unreachable) does not call it missing."""
        if not isinstance(e, FileNotFoundError) or self._bucket_seen:
            return False
        try:
            self.fs.call("GET", "b/{}/o", self.bucket, maxResults=1, json_out=True)
        except FileNotFoundError:
            return True
        except Exception:
            return False
        self._bucket_seen = True
        return False

    def _misconfigured(self, e: Exception) -> bool:
        # gcsfs: 401 is an HttpError, 403 a plain OSError("Forbidden: <url>..."); google-auth's errors
        # when Application Default Credentials cannot be loaded or refreshed.
        _, status = error_code(e)
        return (super()._misconfigured(e) or status == 401
                or type(e).__name__ in ("RefreshError", "DefaultCredentialsError")
                or (type(e) is OSError and str(e).startswith("Forbidden:")))

    # -- replace-if-unchanged (GCS's ifGenerationMatch): the manifests -----------------------------
    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """(content, generation) of `name` from one GET, None if absent."""
        bucket, key = self._key(name).split("/", 1)

        def get():
            try:
                headers, data = self.fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
                generation = headers.get("x-goog-generation")
                if generation is None:
                    # A server that does not send the header (gcp-storage-emulator): the generation
                    # first, then the bytes; if it changes in between, the generation is the older one
                    # and a replace_if with it fails (safe), as with S3's ETag.
                    generation = self.fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)["generation"]
                    _, data = self.fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
                return bytes(data), str(generation)
            except FileNotFoundError as e:
                return self._absent(e)
        return self._retry("read", get)

    def replace_if(self, name: str, data: bytes, etag: str | None) -> str | None:
        """Upload `data` only if `name` still has generation `etag` (None: only if it does not exist);
        the new generation, or None when another writer changed it first (nothing written)."""
        bucket, key = self._key(name).split("/", 1)
        head = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({'name': key})}\n"
                f"--==0==\nContent-Type: application/octet-stream\n\n").encode()
        body = head + data + b"\n--==0==--"

        def put():
            try:
                out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                                   uploadType="multipart", ifGenerationMatch=etag or "0", data=body,
                                   headers={"Content-Type": 'multipart/related; boundary="==0=="'}, json_out=True)
                return str(out["generation"])
            except FileExistsError:      # 412: the generation is no longer `etag`
                return None
            except FileNotFoundError as e:
                return self._absent(e)
        out = self._retry("put", put)
        self.fs.invalidate_cache(self._key(name))
        return out
