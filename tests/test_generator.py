"""The generator daemon as a subprocess: groups in the buffer, versions, filter flags,
reward errors, admission control, weight reloads, SIGTERM flush, bad input."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from buffer import BufferSQL
from conftest import REPO, run_cli
from pipeline.config import load_config, save_config
from pipeline.rundir import write_run_info

SMALL = ["generator.prompts_per_batch=4", "generator.num_generations=4", "generator.flush_groups=4",
         "generator.sampling.max_new_tokens=5", "generator.num_threads=1", "generator.poll_seconds=0.05",
         "generator.log_every_seconds=1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from workers.model import init_model
    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def make_run(tmp_path: Path, tiny: Path, *overrides: str, publish: bool = True) -> Path:
    from workers.model import load_model, load_tokenizer
    from workers.weights import WeightStore

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [*SMALL, *overrides]), run / "config.toml")
    write_run_info(run, {"initial_model": str(tiny), "eval_before": 0.0})
    if publish:
        WeightStore(run / "weights").publish(load_model(tiny), load_tokenizer(tiny), 0)
    return run


def start_generator(run: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "pipeline", "generate", "--run", str(run), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LogLines:
    """A process's log (its stderr) read line by line as it comes, by a thread, so a test can wait for a line."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> int:
        """The index of the first line from `start` on that matches the regex `pattern`, once it is there."""
        deadline = time.time() + timeout
        while True:
            ended = not self._thread.is_alive()          # read before the lines: none can come after
            lines = self.lines[:]
            for i in range(start, len(lines)):
                if re.search(pattern, lines[i]):
                    return i
            start = len(lines)
            assert not ended and time.time() < deadline, (
                f"no line matching {pattern!r} after {timeout:.0f} s{' (the log ended)' if ended else ''}:\n"
                + "".join(lines[-20:]))
            time.sleep(0.1)

    def text(self, timeout: float = 60) -> str:
        """The whole log, once the process closed it."""
        self._thread.join(timeout)
        return "".join(self.lines)


def q(run: Path, sql: str) -> list[dict]:
    return BufferSQL(run).query(sql).to_pylist()


def test_groups_carry_version_logprobs_and_exact_filter_flags(tmp_path, tiny):
    run = make_run(tmp_path, tiny, "generator.max_groups=12", "trainer.max_staleness=none")
    r = run_cli("generate", "--run", str(run), timeout=180)
    assert r.returncode == 0, r.stderr
    assert "Arrow allocator system)" in r.stderr      # malloc, which gives memory back (workers.proc)
    groups = q(run, "SELECT group_id, count(*) n, min(reward) lo, max(reward) hi, bool_and(NOT correct) all_wrong, "
                    "bool_and(correct) all_right, any_value(filtered) f, any_value(filter_reason) why, "
                    "min(version) v0, max(version) v1 FROM rollouts GROUP BY group_id")
    assert len(groups) == 12
    for g in groups:
        assert g["n"] == 4 and g["v0"] == g["v1"] == 0
        assert g["f"] == (g["lo"] == g["hi"])
        expected = None if not g["f"] else "all_wrong" if g["all_wrong"] else "all_correct" if g["all_right"] else "all_equal"
        assert g["why"] == expected
    rows = q(run, "SELECT len(completion_ids) a, len(behavior_logprobs) b, num_tokens, finish_reason, "
                  "list_max(behavior_logprobs) mx, prompt_ids, prompt FROM rollouts")
    assert all(x["a"] == x["b"] == x["num_tokens"] >= 1 and x["mx"] <= 0 for x in rows)
    assert all(x["finish_reason"] in ("stop", "length") for x in rows)
    assert all(x["prompt_ids"][0] == 1 and len(x["prompt_ids"]) == len(x["prompt"]) + 1 for x in rows)


def test_reward_errors_get_the_fallback_and_are_recorded(tmp_path, tiny):
    run = make_run(tmp_path, tiny, "generator.max_groups=8", "trainer.max_staleness=none",
                   'reward.functions=[{name = "accuracy", weight = 0.0}, '
                   '{name = "tests.helpers.gen_rewards:boom_on_odd_length"}]',
                   "reward.fallback_reward=-1.0")
    r = run_cli("generate", "--run", str(run), timeout=180)
    assert r.returncode == 0, r.stderr
    rows = q(run, "SELECT completion, reward, reward_error FROM rollouts")
    assert len(rows) == 32
    for x in rows:
        if len(x["completion"]) % 2:
            assert x["reward"] == -1.0 and "odd length" in x["reward_error"]
        else:
            assert x["reward"] == 0.5 and x["reward_error"] is None


def test_admission_stops_at_the_staleness_budget(tmp_path, tiny):
    # max_staleness 0, 3 groups a step, trainer at v0: at most (0 + 0 + 1) * 3 admitted groups.
    run = make_run(tmp_path, tiny, "trainer.max_staleness=0", "trainer.groups_per_step=3",
                   'reward.functions=[{name = "accuracy", weight = 0.0}, '
                   '{name = "tests.helpers.gen_rewards:boom_on_odd_length"}]',
                   "generator.flush_seconds=0.2")
    p = start_generator(run)
    admitted = lambda: q(run, "SELECT count(*) n FROM groups WHERE NOT filtered")[0]["n"]  # noqa: E731
    try:
        wait_for(lambda: list((run / "buffer" / "writers").glob("*")), 120, "the generator to start")
        wait_for(lambda: admitted() >= 3, 120, "three admitted groups")
        time.sleep(1)            # the batch that filled the step is flushed before the generator waits
        first = admitted()
        time.sleep(2)            # time for another batch, which it must not start
        assert admitted() == first
        assert p.poll() is None  # waiting, not exited
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    # The step's 3, and the trainable groups beyond them in the batch that filled it: appended all
    # the same (nothing generated is dropped), counted as surplus. How many depends on the draw.
    surplus = q(run, "SELECT sum(surplus_groups) n FROM generator_metrics")[0]["n"]
    assert admitted() - surplus == 3 and admitted() == first


def test_reloads_new_weights_and_sigterm_flushes(tmp_path, tiny):
    from workers.model import load_model, load_tokenizer
    from workers.weights import WeightStore

    # Nothing is flushed by size or age before SIGTERM: whatever is in the buffer was flushed on exit.
    run = make_run(tmp_path, tiny, "trainer.max_staleness=none", "generator.flush_groups=100000",
                   "generator.flush_seconds=100000")
    p = start_generator(run)
    log = LogLines(p.stderr)
    try:
        # A progress line comes after a batch: groups of v0 were appended, and none is flushed yet.
        log.wait_for(r"generator \S+: v0, [1-9]\d* groups", 240)
        assert not list((run / "buffer" / "shards").glob("*.parquet"))
        WeightStore(run / "weights").publish(load_model(tiny), load_tokenizer(tiny), 1)
        reloaded = log.wait_for("reloaded weights v0 -> v1", 240)
        log.wait_for(r"generator \S+: v1, \d+ groups", 240, start=reloaded)   # and a batch of v1 after it
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        p.stdout.close()
    err = log.text()
    assert p.returncode == 0, err
    assert "reloaded weights v0 -> v1" in err
    versions = {x["version"]: x["n"] for x in q(run, "SELECT version, count(*) n FROM groups GROUP BY 1")}
    assert versions.get(0, 0) > 0 and versions.get(1, 0) > 0


def test_missing_weights_folder_and_run_dir_are_clear_errors(tmp_path):
    r = run_cli("generate", "--run", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_trainer_refuses_a_buffer_written_with_another_tokenizer(tmp_path, tiny):
    from buffer import ShardWriter
    from conftest import make_group

    run = make_run(tmp_path, tiny, publish=False)
    with ShardWriter(run / "buffer") as w:      # prompt "1+2=" stored with ids [1, 2, 3]
        w.append(make_group(0, [0.0, 1.0]))
    r = run_cli("train", "--run", str(run), timeout=180)
    assert r.returncode == 2, r.stderr
    assert "another tokenizer" in r.stderr and "Traceback" not in r.stderr
