"""az:// run directories: the Store on Azure Blob Storage, through adlfs (issue 18).

az://container/prefix (abfs:// too): the container is the bucket. Azure's blob API has the HTTP
conditions S3 has, with the same names:

    put_new         one Put Blob with `If-None-Match: *` (adlfs: upload_blob(overwrite=False));
                    409 BlobAlreadyExists when the name exists.
    publish         one Put Blob (a block list committed at once for big files): appears whole.
    read_versioned  one Get Blob: the bytes and their ETag.
    replace_if      one Put Blob with `If-Match: <ETag read>` (`If-None-Match: *` when it did not
                    exist); 412 ConditionNotMet means another writer was first: None.
    missing bucket  the error code ContainerNotFound where the SDK's error reaches us; where adlfs
                    turned it into a bare FileNotFoundError (listings), a 404 is the container's
                    when the container does not exist.

The account and its endpoint come from the standard variables: AZURE_STORAGE_CONNECTION_STRING
(Azurite's, in the tests), or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY /
AZURE_STORAGE_SAS_TOKEN / a service principal (AZURE_STORAGE_CLIENT_ID, ...), never from our config
files. The SDK's own retries (3, from 15 s apart) are cut to 1 try more: `_retry` owns the backoff.
"""

from __future__ import annotations

import logging

from buffer.store import DEFAULT_RETRY_S, FsspecStore, StoreError, error_code


def _quoted(etag: str) -> str:
    return '"' + str(etag).strip('"') + '"'


class AzureStore(FsspecStore):
    """A run directory on az://container/prefix; see the module doc for how each write maps."""

    ENDPOINT_VAR = "AZURE_STORAGE_CONNECTION_STRING (its BlobEndpoint) or AZURE_STORAGE_ACCOUNT_NAME"
    CREDENTIALS_HINT = ("AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                        "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN")
    EXTRA = "az"
    BUCKET = "container"

    def __init__(self, uri: str, *, retry_s: float = DEFAULT_RETRY_S):
        self._bucket_seen = False       # the container was seen once: a 404 is a blob's
        super().__init__(uri, retry_s=retry_s)
        # URLs given to DuckDB say abfs://, adlfs's first protocol: DuckDB names a file by it when it
        # checks `allowed_paths`, so an az:// URL there would never match.
        self.scheme = "abfs"

    def _make_fs(self):
        from adlfs import AzureBlobFileSystem

        # The SDK logs every request and response at INFO: into each daemon's log, and `run`'s output.
        logging.getLogger("azure").setLevel(logging.WARNING)

        try:
            fs = AzureBlobFileSystem(skip_instance_cache=True, connection_timeout=5, read_timeout=30)
        except ValueError as e:     # no account named in the environment
            raise StoreError(f"{self.uri}: no Azure storage account to use ({e}); set {self.CREDENTIALS_HINT}") from e
        old = fs.service_client
        fs.service_client = type(old)(account_url=old.url, credential=old.credential, retry_total=1,
                                      initial_backoff=1, increment_base=1, connection_timeout=5, read_timeout=30)
        return fs

    def endpoint(self) -> str:
        return getattr(self.fs.service_client, "url", None) or "the default endpoint"

    def _sync(self, fn):
        from fsspec.asyn import sync
        return sync(self.fs.loop, fn)

    def _bucket_missing(self, e: BaseException) -> bool:
        code, _ = error_code(e)
        if code == "ContainerNotFound":
            return True
        if not isinstance(e, FileNotFoundError) or code is not None or self._bucket_seen:
            return False

        async def exists():
            async with self.fs.service_client.get_container_client(self.bucket) as cc:
                return await cc.exists()
        try:
            if not self._sync(exists):
                return True
        except Exception:
            return False        # cannot tell (unreachable): not called missing
        self._bucket_seen = True
        return False

    def _misconfigured(self, e: Exception) -> bool:
        code, status = error_code(e)
        return (super()._misconfigured(e) or status == 401 or type(e).__name__ == "ClientAuthenticationError"
                or code in ("AuthenticationFailed", "AuthorizationFailure", "InvalidAuthenticationInfo"))

    # -- replace-if-unchanged (If-Match on the ETag): the manifests ---------------------------------
    def read_versioned(self, name: str) -> tuple[bytes, str] | None:
        """(content, ETag) of `name` from one Get Blob, None if absent."""
        from azure.core.exceptions import ResourceNotFoundError

        container, blob = self._key(name).split("/", 1)

        async def get():
            async with self.fs.service_client.get_blob_client(container, blob) as bc:
                stream = await bc.download_blob()
                return await stream.readall(), _quoted(stream.properties.etag)

        def read():
            try:
                return self._sync(get)
            except ResourceNotFoundError as e:
                return self._absent(e)
        return self._retry("read", read)

    def replace_if(self, name: str, data: bytes, etag: str | None) -> str | None:
        """Put `data` only if `name` still has ETag `etag` (None: only if it does not exist); the new
        ETag, or None when another writer changed it first (nothing written)."""
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        key = self._key(name)
        cond = ({"mode": "create"} if etag is None
                else {"etag": etag, "match_condition": MatchConditions.IfNotModified})

        def put():
            try:
                return _quoted(self.fs.pipe_file(key, data, **cond)["etag"])
            except (FileExistsError, ResourceModifiedError):      # 409 exists / 412 ConditionNotMet
                return None
            except (FileNotFoundError, ResourceNotFoundError) as e:
                return self._absent(e)
        out = self._retry("put", put)
        self.fs.invalidate_cache(self._key(name))
        return out

