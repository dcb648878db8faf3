"""A real S3 API server on 127.0.0.1 for the tests (moto's server mode, in its own process), behind a
small TCP relay that a test can take down and bring back (the endpoint refuses connections while
the server keeps its objects), to test retries, or make stall inside one request (`hold`), to kill a
process at an exact point of an upload."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


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


class _Hold:
    """Requests whose request line matches `pattern` get their first `after` bytes (head included)
    through, then nothing more: `reached` is set, and the connection stalls until `released`."""

    def __init__(self, pattern: bytes, after: int):
        self.pattern, self.after = re.compile(pattern), after
        self.reached, self.released = threading.Event(), threading.Event()


class _Stalled(Exception):
    """A held request reached its cut: stop forwarding this connection."""


class Relay:
    """Forwards 127.0.0.1:port to the server; `down()` closes the listener and every connection;
    `hold()` stalls matching requests part-way until `release()`."""

    def __init__(self, target: int):
        self.target, self.port = target, _free_port()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._hold: _Hold | None = None
        self.up()

    def hold(self, pattern: bytes, after: int) -> threading.Event:
        """From now on, a request whose request line matches the regex `pattern` (searched in, e.g.
        rb"^PUT /bucket/run/weights/v00000000/model\\.safetensors ") is forwarded for its first `after`
        bytes only (counted from the start of its request line), then its connection stalls: the server
        waits for the rest, the client for an answer. Returns the event set when a request stalls.
        Every matching request stalls (a client's retry too) until `release()`; a new hold releases
        the last one first."""
        self.release()
        self._hold = _Hold(pattern, after)
        return self._hold.reached

    def release(self) -> None:
        """End the hold: stalled connections are dropped (the server never gets those requests whole)."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.released.set()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        self.release()
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
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, requests: bool = False) -> None:
        """Copy a -> b until either side ends; then end both, and close `a` (the other direction's
        thread closes `b`), so a long test does not run out of file descriptors. `requests`: a is a
        client, whose HTTP requests are followed (for `hold`)."""
        send = _RequestStream(self, b).send if requests else b.sendall
        try:
            while data := a.recv(65536):
                send(data)
        except OSError:
            pass
        except _Stalled as e:
            e.args[0].released.wait()
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            a.close()
            self._conns.discard(a)


class _RequestStream:
    """A client's bytes on their way to the server, cut into HTTP/1.1 requests (a head up to the blank
    line, then Content-Length bytes of body), so a request line is matched only where a request starts,
    however the bytes arrive. A body without Content-Length (chunked) ends the following: the rest of
    that connection is forwarded as it comes, never held."""

    def __init__(self, relay: Relay, server: socket.socket):
        self.relay, self.server = relay, server
        self.head = b""          # the start of a request whose head has not all come yet
        self.body_left = 0       # body bytes of the current request still to come
        self.cut: tuple[_Hold, int] | None = None   # the current request is held: (hold, bytes left to send)
        self.lost = False        # requests no longer followed on this connection

    def send(self, data: bytes) -> None:
        while data:
            if self.lost:
                return self._forward(data)
            if self.body_left:
                n = min(self.body_left, len(data))
                self.body_left -= n
                self._forward(data[:n])
                data = data[n:]
                continue
            self.head += data
            data = b""
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > 1 << 16:        # no head this long: not HTTP as we know it
                    self.lost, data, self.head = True, self.head, b""
                continue
            head, data, self.head = self.head[:end + 4], self.head[end + 4:], b""
            line, _, fields = head.partition(b"\r\n")
            hold = self.relay._hold
            self.cut = None
            if hold is not None and hold.pattern.search(line):
                self.cut = (hold, hold.after)
            length = re.search(rb"(?im)^content-length:[ \t]*(\d+)", fields)
            if re.search(rb"(?im)^transfer-encoding:", fields):
                self.lost = True
            self.body_left = int(length.group(1)) if length else 0
            self._forward(head)

    def _forward(self, data: bytes) -> None:
        if self.cut is not None:
            hold, left = self.cut
            if len(data) >= left:
                self.server.sendall(data[:left])
                hold.reached.set()
                raise _Stalled(hold)
            self.cut = (hold, left - len(data))
        self.server.sendall(data)


class S3Server:
    """moto's S3 server on a free port, its relay, and the environment a client needs."""

    def __init__(self, *, auth: bool = False):
        self.server_port = _free_port()
        env = dict(os.environ)
        if auth:   # enforce credentials: the first 3 requests (user, its policy, its key) are free
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("moto_serial.py")), "127.0.0.1",
                                      str(self.server_port)],
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
        stop_server(self.relay, self.proc)


def stop_server(relay: Relay, proc: subprocess.Popen) -> None:
    """Take the relay down, then end the server (killed if it has not exited 10 s after SIGTERM)."""
    relay.down()
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
