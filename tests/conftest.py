"""Shared helpers: synthetic groups with known contents, and running the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from buffer import Completion, Group

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "runs" / ".cache"   # the warm-started model, shared with `make run` (built once)


def make_group(version: int, rewards, *, prompt_id: str = "p", tokens: int = 4, seed: int = 0,
               correct=None, task: str = "test") -> Group:
    """A group whose token ids and log-probs are a function of (seed, sample index)."""
    rng = np.random.default_rng(seed)
    comps = []
    for i, r in enumerate(rewards):
        ids = rng.integers(0, 64, size=tokens).astype(np.int32)
        comps.append(Completion(
            text=f"c{i}", token_ids=ids, logprobs=-rng.random(tokens).astype(np.float32),
            reward=float(r), reward_components={"accuracy": float(r)},
            correct=None if correct is None else bool(correct[i])))
    return Group(prompt_id=prompt_id, prompt="1+2=", prompt_ids=[1, 2, 3], version=version,
                 completions=comps, task=task)


def run_cli(*args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True,
                          input=input, timeout=timeout, env=env, cwd=REPO)


def run_helper(*args: str, timeout: float = 120) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / args[0]), *args[1:]],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_9_at_pause(argv: list[str], marker: Path, timeout: float = 60) -> None:
    """Start `argv` (a process that writes `marker` when it reaches the point under test, then sleeps),
    wait for the marker, and kill -9 it there."""
    proc = subprocess.Popen(argv, env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else f"no pause in {timeout:.0f} s"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


# `make test` runs the suite on several worker processes (pytest-xdist). The scheduler below hands out
# whole groups: a module's tests stay on one worker, so its module-scoped fixtures are built once. The two
# learning runs, the session's 60-step `default_run` (tests/test_run.py, tests/test_plot.py) and the
# 30-step run in a bucket (tests/test_run_s3.py), are one group, run one after the other: side by side on
# 2 cores (both at 60 steps then) they took 451 s and 478 s, against 135 s and 183 s one after the other.
# The longest groups go first (serial fresh-clone run on 2 cores: the learning group ~350 s, test_ablate
# ~180 with the first build of the warm start, ~65 s of it, test_trainer_fsdp ~80, test_ray_launcher ~60,
# test_chaos ~45, test_chat ~45, test_vllm_backend ~30), so no worker draws a long one late.
LEARNING = ("tests/test_run.py", "tests/test_plot.py", "tests/test_run_s3.py")
LONGEST_FIRST = ("learning", "tests/test_ablate.py", "tests/test_trainer_fsdp.py", "tests/test_ray_launcher.py",
                 "tests/test_chaos.py", "tests/test_chat.py", "tests/test_vllm_backend.py")


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return "learning" if path in LEARNING else path


def pytest_collection_modifyitems(config, items):
    """The longest groups first (LONGEST_FIRST); the order within a group is kept."""
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole groups (group_of) to each worker, in collection order. (xdist's own `--dist loadgroup`
    cannot do it under pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


DEFAULT_RUN_STEPS = 60


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`asyncgrpo run` of the default job as a user runs it, stopped after DEFAULT_RUN_STEPS trainer steps
    (by steps, not time, so a slow or busy machine trains as much as a fast one), with both trackers on and
    a periodic plot every 60 s (a few while it runs, each a child process of ~5 s of CPU beside the daemons;
    every 20 s, a 250-s run in the loaded suite drew about 12). One run for
    tests/test_run.py (learning, SQL invariants, clean stop) and tests/test_plot.py (trackers and plots)."""
    run = tmp_path_factory.mktemp("default_run") / "r"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WANDB_MODE", None)   # W&B offline, the run's default (the test reads the offline files)
    args = [sys.executable, "-m", "pipeline", "run", "--run", str(run), "--set", f"model.cache_dir={CACHE}"]
    for s in (f"trainer.max_steps={DEFAULT_RUN_STEPS}", "run.time_limit_s=none", "run.eval_size=200",
              'run.report_to=["tensorboard", "wandb"]', "run.track_every_s=5", "run.plot_every_s=60"):
        args += ["--set", s]
    # 100-250 s on 2 busy cores
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    return run, p


@pytest.fixture
def buf(tmp_path) -> Path:
    return tmp_path / "buffer"


@pytest.fixture(scope="session")
def s3server():
    """A real S3 API server on 127.0.0.1 (moto's) behind a relay a test can take down; one per session,
    each test in its own bucket."""
    from tests.helpers.s3server import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3env(s3server, monkeypatch):
    """The S3 server's endpoint and credentials in this process's environment."""
    for k, v in s3server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3server


@pytest.fixture(scope="session", params=["fake-gcs-server", "gcp-storage-emulator"])
def gcsserver(request):
    """A real GCS JSON API server on 127.0.0.1 behind a relay, one per kind and session (each test in
    its own bucket); `.preconditions` says whether it honours ifGenerationMatch (see gcsserver.py)."""
    from tests.helpers.gcsserver import GcsServer

    server = GcsServer(request.param)
    yield server
    server.stop()


@pytest.fixture
def gcsenv(gcsserver, monkeypatch):
    """The GCS server's endpoint in this process's environment (STORAGE_EMULATOR_HOST)."""
    for k, v in gcsserver.env.items():
        monkeypatch.setenv(k, v)
    return gcsserver


@pytest.fixture(scope="session")
def azserver():
    """Azurite (Microsoft's Azure Storage emulator) on 127.0.0.1 behind a relay; one per session, each
    test in its own container."""
    from tests.helpers.azserver import AzuriteServer

    server = AzuriteServer()
    yield server
    server.stop()


@pytest.fixture
def azenv(azserver, monkeypatch):
    """Azurite's connection string in this process's environment (AZURE_STORAGE_CONNECTION_STRING)."""
    for k in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in azserver.env.items():
        monkeypatch.setenv(k, v)
    return azserver
