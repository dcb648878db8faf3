"""A real S3 API server on 127.0.0.1 for the tests (moto's server mode, in its own process), behind a
small TCP relay that a test can take down and bring back (the endpoint refuses connections while
the server keeps its objects), to test retries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Relay:
    """Forwards 127.0.0.1:port to the server; `down()` closes the listener and every connection."""

    def __init__(self, target: int):
        self.target, self.port = target, _free_port()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        ls, self._listener = self._listener, None
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept(): close() alone leaves it listening
            except OSError:
                pass
            ls.close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            self._conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        """Copy a -> b until either side ends; then end both, and close `a` (the other direction's
        thread closes `b`), so a long test does not run out of file descriptors."""
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            a.close()
            self._conns.discard(a)


class S3Server:
    """moto's S3 server on a free port, its relay, and the environment a client needs."""

    def __init__(self, *, auth: bool = False):
        self.server_port = _free_port()
        env = dict(os.environ)
        if auth:   # enforce credentials: the first 3 requests (user, its policy, its key) are free
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.server_port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        _wait_port(self.server_port)
        self.relay = Relay(self.server_port)
        self.endpoint = f"http://127.0.0.1:{self.relay.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        if auth:
            import boto3
            iam = boto3.client("iam", endpoint_url=f"http://127.0.0.1:{self.server_port}", region_name="us-east-1",
                               aws_access_key_id="x", aws_secret_access_key="y")
            iam.create_user(UserName="tester")
            iam.put_user_policy(UserName="tester", PolicyName="s3", PolicyDocument=(
                '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'))
            key = iam.create_access_key(UserName="tester")["AccessKey"]
            self.env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.relay.down()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
