"""buffer.store on a local folder and on a real S3 API server (moto's, on 127.0.0.1): create-if-absent
under races, numbered states without lost updates, the single-holder lease, clear errors for a
missing bucket, rejected credentials and an unreachable endpoint, retries while the endpoint is
down, and SQL over the bucket without downloading a DuckDB extension."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from buffer.store import Lease, LeaseHeld, Numbered, StoreError, open_store
from tests.helpers.s3server import S3Server


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A fresh store root: a local folder, or a fresh prefix in a bucket of the S3 server."""
    if request.param == "local":
        return str(tmp_path / "run")
    server = request.getfixturevalue("s3env")
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    return f"s3://{bucket}/runs/r1"


def test_put_new_is_create_if_absent_under_a_race(root):
    store = open_store(root)
    results: dict[int, bool] = {}

    def put(i):
        results[i] = open_store(root).put_new("writers/w-000001.json", f"writer {i}".encode())

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in results.items() if ok]
    assert len(results) == 8 and len(winners) == 1
    assert store.read("writers/w-000001.json") == f"writer {winners[0]}".encode()
    assert store.put_new("writers/w-000001.json", b"late") is False
    assert store.read("writers/w-000001.json") == f"writer {winners[0]}".encode()


def test_publish_read_list_delete(root):
    store = open_store(root)
    assert store.list("shards") == []
    store.publish("shards/b.parquet", b"bb")
    store.publish("shards/a.parquet", b"a")
    store.publish("shards/sub/x.parquet", b"x")      # in a subfolder: not listed with shards/
    assert [(e.name, e.size) for e in store.list("shards")] == [("a.parquet", 1), ("b.parquet", 2)]
    store.delete("shards/a.parquet")
    store.delete("shards/a.parquet")                  # a missing one is fine
    assert [e.name for e in store.list("shards")] == ["b.parquet"]
    with pytest.raises(FileNotFoundError):
        store.read("shards/a.parquet")


def test_numbered_updates_lose_nothing_under_contention(root):
    """4 writers each add 1 to a counter 15 times through Numbered.update: the count is exactly 60 and
    every number from 1 to 60 was created once (the 8 newest are kept)."""
    def work():
        n = Numbered(open_store(root), "state", "counter")
        for _ in range(15):
            n.update(lambda s: {"count": (s or {"count": 0})["count"] + 1})

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    numbered = Numbered(open_store(root), "state", "counter")
    assert numbered.read() == (60, {"count": 60})
    names = [e.name for e in open_store(root).list("state")]
    assert names == [f"counter-{n:012d}.json" for n in range(1, 61)]    # all younger than the grace


def test_numbered_prunes_old_numbers_after_the_grace(root):
    numbered = Numbered(open_store(root), "state", "s", keep=3, grace_s=1.0)
    for i in range(5):
        numbered.update(lambda s, i=i: {"i": i})
    assert numbered.prune() == 0                        # 5 numbers, but all younger than the grace
    time.sleep(1.2)
    numbered.update(lambda s: {"i": 5})                 # number 6, 1.2 s newer than 1..5: 1..3 go
    assert [e.name for e in open_store(root).list("state")] == [f"s-{n:012d}.json" for n in (4, 5, 6)]
    assert numbered.read() == (6, {"i": 5})


def test_a_slow_writer_reads_again_instead_of_recreating_a_pruned_number(root):
    """A writer whose fn takes longer than grace_s / 2 never creates from its old read."""
    numbered = Numbered(open_store(root), "state", "s", keep=1, grace_s=0.4)
    numbered.update(lambda s: {"count": 1})
    calls = []

    def slow_then_fast(state):
        calls.append(state["count"])
        if len(calls) == 1:
            time.sleep(0.3)                              # > grace_s / 2: this read is not used
            Numbered(open_store(root), "state", "s", keep=1, grace_s=0.4).update(lambda s: {"count": s["count"] + 1})
        return {"count": state["count"] + 1}

    assert numbered.update(slow_then_fast) == (3, {"count": 3})
    assert calls == [1, 2]


def test_lease_refuses_a_second_holder_until_the_first_expires(root):
    """A live lease is refused to a second holder; one whose holder stopped renewing is taken ttl_s
    later, and the old holder is fenced. The leases that must stay live are long (60 s), so a slow,
    loaded machine cannot let them expire between two calls; only the one that must expire is short."""
    store = open_store(root)
    first = Lease(store, "leases", "trainer", ttl_s=60.0)
    first.acquire()
    second = Lease(open_store(root), "leases", "trainer", ttl_s=1.0)
    with pytest.raises(LeaseHeld, match=r"another trainer holds this run \(pid \d+ on "):
        second.acquire()
    first.renew()                                  # the holder keeps it
    with pytest.raises(LeaseHeld, match="another trainer holds this run"):
        second.acquire()
    first.release()
    second.acquire()                               # released: taken at once

    short = Lease(store, "leases", "generator", ttl_s=1.0)
    short.acquire()
    time.sleep(3.2)                                # it stops renewing (killed): ttl + 2 s of resolution
    taker = Lease(open_store(root), "leases", "generator", ttl_s=60.0)
    taker.acquire()
    with pytest.raises(LeaseHeld, match="lost its lease"):
        short.renew()                              # fenced: the old holder must stop
    with pytest.raises(LeaseHeld, match="another generator holds this run"):
        short.acquire()                            # the taker's 60 s lease is live


def test_a_lease_is_judged_by_the_stores_clock_not_the_machines(s3env, monkeypatch):
    """An acquirer whose clock runs an hour ahead (or behind) of the holder's: the live lease is still
    refused, and once the holder stops renewing it is taken ttl_s later by the store's clock. The lease
    that must stay live is long (60 s), so a slow machine cannot let it expire between two calls."""
    import buffer.store as store_module

    class Skewed:
        def __init__(self, by):
            self.by = by

        def time(self):
            return time.time() + self.by

        def __getattr__(self, name):
            return getattr(time, name)

    s3env.create_bucket("skew")
    Lease(open_store("s3://skew/run"), "leases", "trainer", ttl_s=60.0).acquire()
    Lease(open_store("s3://skew/run"), "leases", "generator", ttl_s=2.0).acquire()
    for by in (3600.0, -3600.0):
        monkeypatch.setattr(store_module, "time", Skewed(by))
        with pytest.raises(LeaseHeld, match=r"lease valid for \d+ s more"):
            Lease(open_store("s3://skew/run"), "leases", "trainer", ttl_s=2.0).acquire()
    monkeypatch.setattr(store_module, "time", Skewed(-3600.0))
    time.sleep(4.2)                                # the holder stopped renewing: ttl + 2 s of resolution
    Lease(open_store("s3://skew/run"), "leases", "generator", ttl_s=2.0).acquire()


def test_sql_over_the_bucket_without_extensions(s3env):
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    s3env.create_bucket("sqlb")
    store = open_store("s3://sqlb/run")
    for i in range(3):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"version": [i, i], "reward": [1.0, float(i)]}), sink)
        store.publish(f"shards/w-{i}.parquet", sink.getvalue().to_pybytes())
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    store.register(con)
    urls = [store.url(f"shards/{e.name}") for e in store.list("shards")]
    assert con.sql(f"SELECT count(*), sum(reward) FROM read_parquet({urls!r})").fetchall() == [(6, 6.0)]
    table = pq.read_table(store.url("shards/w-2.parquet").split("://", 1)[1], filesystem=store.arrow_filesystem())
    assert table.column("reward").to_pylist() == [1.0, 2.0]


def test_check_names_a_missing_bucket(s3env):
    with pytest.raises(StoreError, match=r"the bucket 'nobucket' does not exist at http://127\.0\.0\.1:"):
        open_store("s3://nobucket/run").check()


def test_check_names_an_unreachable_endpoint(s3env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")      # nothing listens on port 9
    with pytest.raises(StoreError, match=r"cannot reach the endpoint http://127\.0\.0\.1:9 "):
        open_store("s3://any/run", retry_s=0).check()


def test_check_names_rejected_credentials(monkeypatch):
    server = S3Server(auth=True)
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        server.create_bucket("authb")
        open_store("s3://authb/run").check()                          # the right key works
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(StoreError, match="the credentials were rejected"):
            open_store("s3://authb/run").check()
    finally:
        server.stop()


def test_writes_wait_for_the_endpoint_to_come_back(s3env):
    s3env.create_bucket("retryb")
    store = open_store("s3://retryb/run", retry_s=30)
    store.publish("a", b"1")
    s3env.relay.down()
    started = time.monotonic()                       # before the timer: its 2 s all count
    threading.Timer(2.0, s3env.relay.up).start()
    assert store.put_new("b", b"2") is True
    assert 1.5 < time.monotonic() - started < 20
    assert store.read("b") == b"2"
    s3env.relay.down()
    try:
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            open_store("s3://retryb/run", retry_s=1).read("a")
        assert time.monotonic() - started < 15
        assert not isinstance(info.value, FileNotFoundError)
    finally:
        s3env.relay.up()


def test_a_lease_of_a_killed_process_of_this_host_is_free_at_once(root):
    import subprocess
    import sys

    code = ("import sys; from buffer.store import Lease, open_store; "
            "Lease(open_store(sys.argv[1]), 'leases', 'trainer', ttl_s=600).acquire(); print('held', flush=True); "
            "import time; time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, root], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=rf"pid {p.pid} on "):
            Lease(open_store(root), "leases", "trainer").acquire()
    finally:
        p.kill()
        p.wait()
    Lease(open_store(root), "leases", "trainer").acquire()      # its holder is gone: no 600 s wait


def test_bucket_and_key_names_are_never_read_as_errors(s3env):
    """A missing key named like an error ('...503...') in a bucket named '...bucket...' is a plain
    FileNotFoundError at once (not retried as a 5xx), and an empty prefix lists as empty."""
    s3env.create_bucket("my-bucket-503")
    store = open_store("s3://my-bucket-503/run", retry_s=60)
    assert store.list("shards") == []
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        store.read("ledger/step-000001503-0000.parquet")
    assert time.monotonic() - started < 30                  # not retried for retry_s (60 s)
    store.publish("InternalError-500 .json", b"{}")
    assert [e.name for e in store.list("")] == ["InternalError-500 .json"]


def test_a_lease_lock_is_renewed_while_held_and_refuses_writes_once_it_lapsed(s3env):
    from buffer.store import LeaseLock, store_path

    s3env.create_bucket("leaselock")
    path = store_path("s3://leaselock/run") / "buffer.lock"
    held = LeaseLock(path, ttl_s=6.0)                 # renewed every 2 s: a renewal may come 2 s late
    held.acquire()
    time.sleep(6.5)                                   # longer than the lease: the renewals keep it
    held.assert_held()
    with pytest.raises(Exception, match="Timeout|buffer.lock"):
        LeaseLock(path, ttl_s=6.0).acquire(timeout=0.5)
    held._stop.set()                                  # as if paused: no more renewals
    held._thread.join()
    time.sleep(4.1)                                   # past 2/3 of the lease since the last renewal began
    with pytest.raises(LeaseHeld, match="the lease of this process lapsed"):
        held.assert_held()
    other = LeaseLock(path, ttl_s=6.0)
    other.acquire(timeout=30)                         # expired: the next holder takes it
    other.release()
    assert other._thread is None                      # the renewal thread is joined on release


@pytest.mark.parametrize("renewal", ["succeeds", "fails"])
def test_a_lapsed_lease_lock_waits_for_the_renewal_in_flight_and_follows_its_outcome(s3env, renewal):
    """The validity window closes while a renewal is in flight (the store slow, or down for a few
    seconds): assert_held waits for it, then passes if it renewed and raises LeaseHeld if it lost the lease."""
    from buffer.store import LeaseLock, store_path

    bucket = s3env.create_bucket(f"inflight-{uuid.uuid4().hex[:8]}")
    lock = LeaseLock(store_path(f"s3://{bucket}/run") / "buffer.lock", ttl_s=600.0)   # the thread's tick: 200 s
    lock.acquire()
    renew, entered, answer = lock._lease.renew, threading.Event(), threading.Event()

    def slow_renew():                                 # the store answers when the test says so
        entered.set()
        answer.wait(60)
        if renewal == "fails":
            raise LeaseHeld("another trainer took the lease")
        renew()

    lock._lease.renew = slow_renew
    try:
        renewing = threading.Thread(target=lock._renew, args=(lock._stop,))   # the thread's tick, driven here
        renewing.start()
        assert entered.wait(60)
        lock._valid_until = time.monotonic() - 1.0   # the window closes while the renewal is in flight
        outcome = []

        def check():
            try:
                lock.assert_held()
                outcome.append("held")
            except LeaseHeld as e:
                outcome.append(e)

        checking = threading.Thread(target=check)
        checking.start()
        checking.join(1.0)
        assert checking.is_alive() and outcome == []  # neither raised nor returned: it waits for the renewal
        answer.set()
        renewing.join(60)
        checking.join(60)
        if renewal == "succeeds":
            assert outcome == ["held"]
            lock.assert_held()                        # valid for 2/3 of the lease from the renewal's start
        else:
            assert len(outcome) == 1 and isinstance(outcome[0], LeaseHeld), outcome
            assert "the lease of this process lapsed" in str(outcome[0])
    finally:
        answer.set()
        lock._lease.renew = renew
        lock.release()
