"""kill -9 placed exactly inside an upload to S3 (issue 18: "nothing partial is ever read, nothing
flushed is lost, resume works"). The relay in front of moto's server (tests/helpers/s3server.py)
forwards the first bytes of one chosen request, then stalls it; the test kills the uploading process
there, drops the connection, and checks what readers see and that a restarted process goes on:

    the trainer inside the PUT of v0's model.safetensors   no version is visible; --resume publishes v0 whole
    a generator inside the PUT of its third shard          its first two shards are read whole, the third
                                                            nowhere; a restarted generator appends on
    a process inside UploadPart #2 of a multipart upload   no object; a retry uploads it whole; the
                                                            compactor's sweep aborts the leftover upload

and the hold itself: matched only where a request starts, however its bytes arrive.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from buffer import BufferSQL
from buffer.store import FsspecStore, open_store, store_path
from conftest import REPO
from workers.remote_weights import COMPLETE, RemoteWeights, WeightsError, open_weights

HELD_S = 60     # the longest a test waits for its upload to reach the hold


@pytest.fixture
def bucket(s3env):
    name = s3env.create_bucket(f"k-{uuid.uuid4().hex[:8]}")
    yield name
    s3env.relay.release()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from workers.model import init_model

    return init_model(tmp_path_factory.mktemp("m") / "tiny", seed=3)


def _env(server, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **server.env, **extra}


def _start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """proc's exit status; killed if it is still running after `timeout` s (the test then fails on it)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _kill_when_held(proc: subprocess.Popen, held, log: Path, relay) -> None:
    """Wait until the held request stalls (the process is inside that upload), kill -9 the process,
    then drop the stalled connection."""
    deadline = time.monotonic() + HELD_S
    while not held.wait(0.1):
        assert proc.poll() is None, f"exited {proc.returncode} before the hold:\n{log.read_text()[-4000:]}"
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no upload reached the hold in {HELD_S} s:\n{log.read_text()[-4000:]}")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    relay.release()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _uploads(server, bucket: str) -> list[str]:
    """Keys of the bucket's incomplete multipart uploads."""
    return sorted(u["Key"] for u in server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


# -- the relay's hold ---------------------------------------------------------------------------------

def _put(path: str, body: bytes) -> bytes:
    return f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def _response(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b"\r\n", 1)[0]


def test_the_relay_holds_a_request_where_it_starts_however_its_bytes_arrive(s3env, bucket):
    """A request line inside another request's body is not held; a matching request later on the same
    kept-alive connection is, its head sent a byte at a time; release drops it, the object never appears."""
    relay = s3env.relay
    held_request = _put(f"/{bucket}/held", b"x" * 100)
    held = relay.hold(rb"^PUT /%s/held " % bucket.encode(), after=len(held_request) - 90)
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        for b in _put(f"/{bucket}/first", held_request):          # its body is a matching request
            conn.sendall(bytes([b]))
        assert _response(conn) == b"HTTP/1.1 200 OK" and not held.is_set()
        for b in held_request:
            conn.sendall(bytes([b]))
        assert held.wait(10)
        relay.release()
        try:
            assert conn.recv(65536) == b""                         # dropped, with no answer
        except ConnectionResetError:
            pass
    client = s3env.client()
    assert client.get_object(Bucket=bucket, Key="first")["Body"].read() == held_request
    assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])] == ["first"]


# -- the trainer, inside its weights upload --------------------------------------------------------

def _trainer(url: str, model_folder: Path, env: dict, log: Path, *flags: str) -> subprocess.Popen:
    cfg = {"num_threads": 1, "metrics_flush_seconds": 0.0}
    return _start([sys.executable, "-m", "workers.trainer.main", "--run", url, "--model-folder", str(model_folder),
                   "--config", json.dumps(cfg), *flags], env, log)


def test_a_trainer_killed_inside_its_weights_upload_publishes_nothing_and_resumes(
        s3env, bucket, model_folder, tmp_path):
    url = f"s3://{bucket}/run"
    env = _env(s3env, ASYNCGRPO_WORK=str(tmp_path / "work"))
    weights = model_folder / "model.safetensors"
    # The head and 4 KiB of the weights' body reach the server; the rest never does.
    held = s3env.relay.hold(rb"^PUT /%s/run/weights/v00000000/model\.safetensors " % bucket.encode(), after=5000)
    first = _trainer(url, model_folder, env, tmp_path / "first.log")
    _kill_when_held(first, held, tmp_path / "first.log", s3env.relay)

    run = open_store(url)
    names = {e.name for e in run.list("weights/v00000000")}
    assert "config.json" in names                                   # killed in the middle of v0's files,
    assert COMPLETE not in names and "model.safetensors" not in names   # with no partial object
    assert RemoteWeights(run).latest() is None and RemoteWeights(run).versions() == []
    cache = tmp_path / "cache"
    assert open_weights(store_path(url), cache=cache).latest() is None
    with pytest.raises(WeightsError, match=r"v00000000 is not published \(no COMPLETE\.json"):
        RemoteWeights(run, cache=cache).fetch(0)
    assert not any(p.is_file() for p in cache.rglob("*"))                              # nothing cached

    second = _trainer(url, model_folder, env, tmp_path / "second.log", "--resume")
    try:
        deadline = time.monotonic() + 60
        while RemoteWeights(run).latest() != 0:
            assert second.poll() is None, (tmp_path / "second.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "second.log").read_text()[-4000:]
            time.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        rc = _wait(second, 60)
    assert rc == 0, (tmp_path / "second.log").read_text()[-4000:]
    # A new store: this one listed weights/v00000000/ before COMPLETE.json was there, and s3fs's cat_file
    # asks the size of what it reads from that cached listing (FileNotFoundError).
    run = open_store(url)
    listing = json.loads(run.read(f"weights/v00000000/{COMPLETE}"))
    assert "model.safetensors" in listing and listing["model.safetensors"][0] == weights.stat().st_size
    for name, (size, sha) in listing.items():
        data = run.read(f"weights/v00000000/{name}")
        assert (len(data), _sha256(data)) == (size, sha), name
    gen = RemoteWeights(open_store(url), cache=cache)
    folder = gen.fetch(0)
    assert gen.verify_cached(0)
    assert (folder / "model.safetensors").read_bytes() == run.read("weights/v00000000/model.safetensors")


# -- a generator, inside a shard's upload ----------------------------------------------------------

GEN_SETS = ("generator.prompts_per_batch=4", "generator.flush_groups=4", "generator.num_generations=4",
            "generator.flush_seconds=600", "generator.num_threads=1", "generator.sampling.max_new_tokens=4")


def _generator(url: str, env: dict, log: Path, *sets: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pipeline", "generate", "--run", url]
    for s in sets:
        argv += ["--set", s]
    return _start(argv, env, log)


def _groups(url: str) -> dict[str, int]:
    """Groups in the buffer by the shard (file) they are in, as SQL reads them."""
    rows = BufferSQL(url).query("SELECT regexp_extract(group_id, '^(.*)-[0-9]+$', 1) w, count(DISTINCT group_id) n "
                                "FROM rollouts GROUP BY 1 ORDER BY 1").to_pylist()
    return {r["w"]: r["n"] for r in rows}


def test_a_generator_killed_inside_a_shard_upload_loses_no_flushed_group(s3env, bucket, model_folder, tmp_path):
    from pipeline.config import load_config, save_config

    url = f"s3://{bucket}/run"
    save_config(load_config(), store_path(url) / "config.toml")
    RemoteWeights(open_store(url)).upload(model_folder, 0)          # what the trainer publishes first
    spool = tmp_path / "spool"                                        # where shards wait for their upload
    spool.mkdir()
    env = _env(s3env, ASYNCGRPO_WORK=str(tmp_path / "work"), TMPDIR=str(spool))
    # Its third shard (groups 8-11): the head and 4 KiB of the body reach the server.
    held = s3env.relay.hold(rb"^PUT /%s/run/buffer/shards/[^ ?/]+-000002\.parquet " % bucket.encode(), after=5000)
    first = _generator(url, env, tmp_path / "first.log", *GEN_SETS)
    _kill_when_held(first, held, tmp_path / "first.log", s3env.relay)

    run = open_store(url)
    shards = [e.name for e in run.list("buffer/shards")]
    assert len(shards) == 2 and [n[-14:] for n in shards] == ["000000.parquet", "000001.parquet"], shards
    assert min(e.size for e in run.list("buffer/shards")) > 5000     # as the held one: cut inside its body
    writer = shards[0][:-len("-000000.parquet")]
    assert _groups(url) == {writer: 8}                                # both flushed shards, whole
    assert [p.name for p in spool.iterdir()] != []                    # the killed upload's spool file

    second = _generator(url, env, tmp_path / "second.log", *GEN_SETS, "generator.max_groups=8")
    assert _wait(second, 120) == 0, (tmp_path / "second.log").read_text()[-4000:]
    groups = _groups(url)
    assert len(groups) == 2 and groups[writer] == 8 and sum(groups.values()) == 16, groups
    n = BufferSQL(url).query("SELECT count(*) n, count(DISTINCT group_id) g FROM rollouts").to_pylist()[0]
    assert n == {"n": 16 * 4, "g": 16}                                # every group once, G = 4 each
    assert not any(p.name.startswith(f"asyncgrpo-{first.pid}-") for p in spool.iterdir())   # spool cleaned


# -- a process inside UploadPart #2 of a multipart upload --------------------------------------------

UPLOAD = """
import sys
from pathlib import Path
from buffer.store import open_store
open_store(sys.argv[1]).upload(sys.argv[2], Path(sys.argv[3]))
"""


def test_a_kill_inside_a_multipart_upload_leaves_no_object_and_the_sweep_aborts_it(s3env, bucket, tmp_path,
                                                                                   monkeypatch):
    import workers.compactor
    from workers.compactor import CompactorConfig, run_compactor
    from workers.stop import StopFlag

    url, name = f"s3://{bucket}/run", "buffer/shards/c-000001-big.parquet"
    big = tmp_path / "big"
    big.write_bytes(os.urandom(11 * 2**20))          # parts of 5, 5 and 1 MiB
    env = _env(s3env, ASYNCGRPO_STORE_PART_MB="5")
    held = s3env.relay.hold(rb"^PUT /%s/run/%s\?(.*&)?partNumber=2[& ]" % (bucket.encode(), name.encode()),
                            after=64 * 1024)
    log = tmp_path / "upload.log"
    proc = _start([sys.executable, "-c", UPLOAD, url, name, str(big)], env, log)
    _kill_when_held(proc, held, log, s3env.relay)

    run = open_store(url)
    assert [e.name for e in run.list("buffer/shards")] == []
    with pytest.raises(FileNotFoundError):
        run.read(name)
    assert _uploads(s3env, bucket) == [f"run/{name}"]          # the killed upload's parts, under no name

    retry = subprocess.run([sys.executable, "-c", UPLOAD, url, name, str(big)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert retry.returncode == 0, retry.stderr
    assert [(e.name, e.size) for e in run.list("buffer/shards")] == [("c-000001-big.parquet", 11 * 2**20)]
    assert _sha256(run.read(name)) == _sha256(big.read_bytes())
    assert _uploads(s3env, bucket) == [f"run/{name}"]          # still the killed one alone

    # The compactor's housekeeping, with no age bound (moto dates every upload 2010-11-10 anyway).
    monkeypatch.setattr(workers.compactor, "STALE_UPLOAD_S", 0.0)
    stop = StopFlag(install_signals=False)
    stop.wait = lambda _s: stop.set()                             # one pass
    cfg = CompactorConfig(every_s=1.0, min_free_gb=None)
    totals = run_compactor(url, cfg, stop)
    assert totals["aborted_uploads"] == 1 and _uploads(s3env, bucket) == []
    assert _sha256(run.read(name)) == _sha256(big.read_bytes())   # the complete object is untouched
    assert isinstance(run, FsspecStore) and run.abort_incomplete_uploads(0) == []


def test_the_part_size_is_checked(s3env, bucket, tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"x")
    monkeypatch.setenv("ASYNCGRPO_STORE_PART_MB", "4")
    with pytest.raises(Exception, match=r"ASYNCGRPO_STORE_PART_MB='4': must be a number of MiB >= 5"):
        open_store(f"s3://{bucket}/run").upload("f", tmp_path / "f")
