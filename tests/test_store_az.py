"""buffer.store on az://, against Azurite (Microsoft's Azure Storage emulator) on 127.0.0.1
(tests/helpers/azserver.py): the store contract of test_store_gcs.py, run again on a container
(Azurite honours If-None-Match and If-Match: nothing is expected to fail), and what differs: the
errors (a missing container, a rejected account key, an unreachable endpoint) and the retries."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from buffer.store import StoreError, open_store, store_path
from conftest import run_cli
from tests.helpers.azserver import connection_string
from tests.test_store_gcs import (  # noqa: F401 - collected again, here on az://
    test_a_buffer_on_gcs_written_sampled_and_queried as test_a_buffer_on_az_written_sampled_and_queried,
    test_a_manifest_write_after_someone_elses_fails_instead_of_overwriting_it,
    test_a_missing_object_in_a_bucket_is_a_plain_file_not_found,
    test_check_passes_on_a_bucket,
    test_numbered_updates_from_two_writers_lose_nothing,
    test_publish_read_list_list_folders_delete,
    test_put_new_is_create_if_absent_under_a_race,
    test_put_new_twice_creates_once,
    test_replace_if_takes_the_generation_read_and_refuses_a_stale_one,
)


@pytest.fixture
def needs_preconditions():
    """Azurite honours them: nothing to mark."""


@pytest.fixture
def root(azenv):
    container = azenv.create_container(f"c-{uuid.uuid4().hex[:8]}")
    return f"az://{container}/runs/r1"


@pytest.fixture
def buf(root):
    return store_path(root) / "buffer"


def test_a_missing_container_is_one_store_error_naming_it(azenv):
    store = open_store("az://no-such-container/run", retry_s=5)
    with pytest.raises(StoreError, match=r"the container 'no-such-container' does not exist at http://127\.0\.0\.1:"):
        store.check()
    with pytest.raises(StoreError, match="the container 'no-such-container' does not exist"):
        store.list("shards")
    with pytest.raises(StoreError, match="the container 'no-such-container' does not exist"):
        store.read("buffer.json")
    with pytest.raises(StoreError, match="the container 'no-such-container' does not exist"):
        store.put_new("writers/w000001.json", b"{}")


def test_a_cli_command_on_a_missing_container_says_so(azenv):
    r = run_cli("status", "az://no-such-container/run")
    assert r.returncode == 2, r.stderr
    assert "the container 'no-such-container' does not exist at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr


def test_check_names_a_rejected_key(azenv, monkeypatch):
    container = azenv.create_container(f"c-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(azenv.endpoint, "A" * 86 + "=="))
    with pytest.raises(StoreError, match=r"(?s)the credentials were rejected at http://127\.0\.0\.1:.*AZURE_STORAGE_"):
        open_store(f"az://{container}/run").check()


def test_check_names_an_unreachable_endpoint(azenv, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string("http://127.0.0.1:9"))
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach the endpoint http://127\.0\.0\.1:9/"):
        open_store("az://any/run", retry_s=0).check()
    assert time.monotonic() - started < 15


def test_no_account_in_the_environment_is_one_store_error(monkeypatch):
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(StoreError, match="no Azure storage account to use.*AZURE_STORAGE_CONNECTION_STRING"):
        open_store("az://any/run")


def test_writes_wait_for_the_endpoint_to_come_back(root, azenv):
    store = open_store(root, retry_s=30)
    store.publish("a", b"1")
    azenv.relay.down()
    started = time.monotonic()                         # before the timer: the write waits >= 2 s from here
    threading.Timer(2.0, azenv.relay.up).start()
    assert store.put_new("b", b"2") is True
    assert 1.5 < time.monotonic() - started < 20
    assert store.read("b") == b"2"
