"""buffer.store on gs://, against real GCS JSON API servers on 127.0.0.1 (tests/helpers/gcsserver.py):
the store's contract (create-if-absent, replace-if-unchanged by generation, listings, numbered states
without lost updates, clear errors for a missing bucket and an unreachable endpoint, retries while
the endpoint is down) and a small buffer written by the real ShardWriter and read back by the real
Sampler and BufferSQL.

Each test runs on both servers. gcp-storage-emulator ignores ifGenerationMatch, so the tests that need
it are strict xfails there (they fail the run the day it honours them); fake-gcs-server honours it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from buffer import BufferError, BufferSQL, Sampler, ShardWriter
from buffer.layout import BufferDir
from buffer.store import Numbered, StoreError, open_store, store_path
from conftest import make_group, run_cli


@pytest.fixture
def needs_preconditions(gcsenv, request):
    """For a test that needs ifGenerationMatch honoured: a strict xfail on a server that ignores it."""
    if not gcsenv.preconditions:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"{gcsenv.kind} ignores ifGenerationMatch: "
                                              "a conditional write overwrites"))


@pytest.fixture
def root(gcsenv):
    bucket = gcsenv.create_bucket(f"b-{uuid.uuid4().hex[:8]}")
    return f"gs://{bucket}/runs/r1"


def test_put_new_twice_creates_once(root, needs_preconditions):
    store = open_store(root)
    assert store.put_new("writers/w-000001.json", b"first") is True
    assert store.put_new("writers/w-000001.json", b"second") is False
    assert store.read("writers/w-000001.json") == b"first"


def test_put_new_is_create_if_absent_under_a_race(root, needs_preconditions):
    results: dict[int, bool] = {}

    def put(i):
        results[i] = open_store(root).put_new("writers/w-000002.json", f"writer {i}".encode())

    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(results) == 6 and len(winners) == 1
    assert open_store(root).read("writers/w-000002.json") == f"writer {winners[0]}".encode()


def test_publish_read_list_list_folders_delete(root):
    store = open_store(root)
    assert store.list("shards") == [] and store.list_folders("") == []
    store.publish("shards/b.parquet", b"bb")
    store.publish("shards/a.parquet", b"a")
    store.publish("shards/sub/x.parquet", b"x")      # in a subfolder: not listed with shards/
    store.publish("ledger/step-1.parquet", b"l")
    assert [(e.name, e.size) for e in store.list("shards")] == [("a.parquet", 1), ("b.parquet", 2)]
    assert all(abs(e.mtime - time.time()) < 60 for e in store.list("shards"))   # the store's clock
    assert store.list_folders("") == ["ledger", "shards"] and store.list_folders("shards") == ["sub"]
    assert store.read("shards/b.parquet") == b"bb"
    store.publish("shards/b.parquet", b"replaced")   # publish is a plain whole write
    assert store.read("shards/b.parquet") == b"replaced"
    store.delete("shards/a.parquet")
    store.delete("shards/a.parquet")                  # a missing one is fine
    assert [e.name for e in store.list("shards")] == ["b.parquet"]
    with pytest.raises(FileNotFoundError):
        store.read("shards/a.parquet")


def test_replace_if_takes_the_generation_read_and_refuses_a_stale_one(root, needs_preconditions):
    store = open_store(root)
    assert store.read_versioned("manifest.json") is None
    first = store.replace_if("manifest.json", b"v1", None)            # only if absent: created
    assert first is not None
    assert store.replace_if("manifest.json", b"again", None) is None  # exists now: refused
    data, gen = store.read_versioned("manifest.json")
    assert (data, gen) == (b"v1", first)
    second = store.replace_if("manifest.json", b"v2", gen)
    assert second is not None and second != first
    assert store.replace_if("manifest.json", b"stale", gen) is None   # the generation read is gone
    assert store.read_versioned("manifest.json") == (b"v2", second)


def test_numbered_updates_from_two_writers_lose_nothing(root, needs_preconditions):
    """2 writers each add 1 to a counter 10 times through Numbered.update: exactly 20, each number once."""
    def work():
        n = Numbered(open_store(root), "state", "counter")
        for _ in range(10):
            n.update(lambda s: {"count": (s or {"count": 0})["count"] + 1})

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Numbered(open_store(root), "state", "counter").read() == (20, {"count": 20})
    assert [e.name for e in open_store(root).list("state")] == [f"counter-{n:012d}.json" for n in range(1, 21)]


def test_a_missing_bucket_is_one_store_error_naming_it(gcsenv):
    store = open_store("gs://no-such-bucket/run", retry_s=5)
    with pytest.raises(StoreError, match=r"the bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1:"):
        store.check()
    with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist"):
        store.list("shards")                           # not an empty listing
    with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist"):
        store.read("buffer.json")                      # not a missing file
    with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist"):
        store_path("gs://no-such-bucket/run").is_file()


def test_a_cli_command_on_a_missing_bucket_says_so(gcsenv):
    r = run_cli("status", "gs://no-such-bucket/run")
    assert r.returncode == 2, r.stderr
    assert "the bucket 'no-such-bucket' does not exist at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_object_in_a_bucket_is_a_plain_file_not_found(root):
    store = open_store(root, retry_s=60)
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        store.read("ledger/step-000001503-0000.parquet")
    assert time.monotonic() - started < 30             # not retried until retry_s
    assert not (store_path(root) / "x").is_file()


def test_check_names_an_unreachable_endpoint(gcsenv, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")      # nothing listens on port 9
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach the endpoint http://127\.0\.0\.1:9 .*STORAGE_EMULATOR_HOST"):
        open_store("gs://any/run", retry_s=0).check()
    assert time.monotonic() - started < 15


def test_writes_wait_for_the_endpoint_to_come_back(root, gcsenv):
    store = open_store(root, retry_s=30)
    store.publish("a", b"1")
    gcsenv.relay.down()
    started = time.monotonic()                         # before the timer: the write waits >= 2 s from here
    threading.Timer(2.0, gcsenv.relay.up).start()
    store.publish("b", b"2")
    assert 1.5 < time.monotonic() - started < 20
    assert store.read("b") == b"2"


def test_check_passes_on_a_bucket(root):
    open_store(root).check()


# -- a small buffer on gs:// ---------------------------------------------------------------------

@pytest.fixture
def buf(root):
    return store_path(root) / "buffer"


def _fill(buf, n):
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        return [w.append(make_group(i % 3, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i, correct=[1, 0, 0, 1]))
                for i in range(n)]


def test_a_buffer_on_gcs_written_sampled_and_queried(buf):
    ids = _fill(buf, 6)
    assert BufferDir.is_buffer(buf)
    assert [e.name for e in buf.store.list(buf.key)] == ["buffer.json"]      # no lock or tmp files
    with Sampler(buf) as s:
        with pytest.raises(BufferError, match="another trainer"):
            Sampler(buf)
        first = s.pull(2, trainer_version=2, trainer_step=1, max_staleness=None).group_ids
        second = s.pull(2, trainer_version=2, trainer_step=2, max_staleness=None).group_ids
    assert len(set(first + second)) == 4 and set(first + second) <= set(ids)
    with Sampler(buf) as s:                        # reopened: the ledger is replayed, nothing twice
        rest = s.pull(2, trainer_version=2, trainer_step=3, max_staleness=None).group_ids
    assert sorted(first + second + rest) == sorted(ids)
    sql = BufferSQL(buf)
    assert sql.query("SELECT count(*) AS r, count(DISTINCT group_id) AS g FROM rollouts").to_pylist() == \
        [{"r": 24, "g": 6}]
    assert sql.query("SELECT count(*) AS n FROM consumed").to_pylist() == [{"n": 6}]


def test_a_manifest_write_after_someone_elses_fails_instead_of_overwriting_it(buf, needs_preconditions):
    _fill(buf, 2)
    paused, current = BufferDir(buf).shard_set, BufferDir(buf).shard_set
    old = paused.read_manifest()
    current.swap(current.read_manifest(), [], ["gone.parquet"], now=1.0)
    with pytest.raises(BufferError, match=r"manifest\.json was changed by another process"):
        paused.swap(old, [], ["other.parquet"], now=2.0)
    assert BufferDir(buf).read_manifest().replaced == {"gone.parquet": 1.0}
