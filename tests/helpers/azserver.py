"""Azurite, Microsoft's Azure Storage emulator (its blob service, in memory), on 127.0.0.1 behind the
relay of s3server.py, for the az:// tests. `make install` puts it in .cache/azurite (npm). It honours
`If-None-Match: *` and `If-Match` on Put Blob and checks the shared-key signature of each request."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.s3server import Relay, _free_port, _wait_port

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"      # Azurite's well-known development account and key
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def connection_string(endpoint: str, key: str = KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


class AzuriteServer:
    """Azurite's blob service on a free port, its relay, and the environment a client needs."""

    def __init__(self):
        if not AZURITE.exists():
            raise RuntimeError(f"Azurite is not installed at {AZURITE}: run `make install` (npm install "
                               "--prefix .cache/azurite azurite@3.37.0)")
        self.server_port = _free_port()
        # --skipApiVersionCheck: azure-storage-blob may speak a newer API version than this Azurite knows.
        self.proc = subprocess.Popen([str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(self.server_port),
                                      "--inMemoryPersistence", "--silent", "--skipApiVersionCheck"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.server_port)
        self.relay = Relay(self.server_port)
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"
        self.env = {"AZURE_STORAGE_CONNECTION_STRING": connection_string(self.endpoint)}

    def create_container(self, name: str) -> str:
        from azure.storage.blob import BlobServiceClient

        direct = connection_string(f"http://127.0.0.1:{self.server_port}")
        with BlobServiceClient.from_connection_string(direct) as client:
            client.create_container(name)
        return name

    def stop(self) -> None:
        self.relay.down()
        self.proc.kill()        # in memory, nothing to keep; on SIGTERM it takes 10 s to close
        self.proc.wait(10)
