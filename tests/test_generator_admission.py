"""The generator's admission gate (workers.generator.AdmissionGate), in process on a real buffer:
exact allowances, which batches skip the index check (newer versions, other writers, a lone
writer), waiting for the next version, lockstep."""

from __future__ import annotations

import threading
import time

from buffer import GroupIndex, ShardWriter
from conftest import make_group
from workers.generator import Admission, AdmissionGate, GeneratorConfig, TrainableShare
from workers.generator_stats import GeneratorStats
from workers.stop import StopFlag
from workers.weights import LATEST, WeightStore


class Setup:
    def __init__(self, tmp_path, *, max_staleness: int, poll_seconds: float = 60.0):
        self.weights = tmp_path / "weights"
        self.weights.mkdir()
        self.publish(0)
        self.writer = ShardWriter(tmp_path / "buffer", flush_groups=10_000, flush_seconds=10_000)
        self.trainable = TrainableShare()
        cfg = GeneratorConfig(prompts_per_batch=4, poll_seconds=poll_seconds)
        stats = GeneratorStats(tmp_path, "gen0", self.writer.writer_id, 10_000)
        self.gate = AdmissionGate(GroupIndex(tmp_path / "buffer", retire=True), self.writer, self.trainable,
                                  Admission(max_staleness=max_staleness, groups_per_step=4),
                                  WeightStore(self.weights), cfg, stats)

    def publish(self, version: int) -> None:
        (self.weights / LATEST).write_text(str(version))

    def append(self, n: int, trainable: bool = True) -> None:
        for _ in range(n):
            self.writer.append(make_group(0, [0.0, 1.0] if trainable else [1.0, 1.0]))
            self.trainable.record(trainable)
            self.trainable.appended(trainable)

    def wait(self) -> tuple[int | None, float]:
        return self.gate.wait(StopFlag(install_signals=False))


def test_a_check_is_spent_by_the_batches_it_fills_then_the_gate_waits_for_the_next_version(tmp_path):
    s = Setup(tmp_path, max_staleness=2)          # limit at v0: (2 + 0 + 1) * 4 = 12 trainable groups
    assert s.wait()[0] == 12 and s.gate.checks == 1
    s.append(4)
    assert s.wait()[0] == 8 and s.gate.checks == 1     # what is left fills a batch of 4: no check
    s.append(4)
    assert s.wait()[0] == 4 and s.gate.checks == 1
    s.append(4)                                         # 0 left: a check, which finds the limit reached
    threading.Timer(0.5, s.publish, (1,)).start()       # the trainer publishes v1: limit 16
    allowance, waited = s.wait()
    assert allowance == 4 and waited >= 0.5
    # One check at v0 (limit reached; the waiting groups are flushed for the trainer), then only
    # LATEST was read until it named v1, and one check there.
    assert s.gate.checks == 3
    assert s.writer.pending_groups == 0 and s.writer.num_shards_written == 1
    s.writer.close()


def test_a_filtered_group_does_not_spend_the_allowance(tmp_path):
    s = Setup(tmp_path, max_staleness=2)
    assert s.wait()[0] == 12
    s.append(6, trainable=False)
    s.append(2)
    # Trainable share 2/8: 10 left would take ceil(10 / 0.25) = 40 prompts, so a batch of 4 is full.
    assert s.wait()[0] == 10 and s.gate.checks == 1
    s.writer.close()


def test_a_newer_version_raises_the_grant_without_a_check(tmp_path):
    s = Setup(tmp_path, max_staleness=2)
    s.publish(2)                                  # limit at v2: (2 + 2 + 1) * 4 = 20
    assert s.wait()[0] == 20 and s.gate.checks == 1
    s.append(8)
    s.publish(3)                                  # limit 24: 20 + 4 - 8 = 16 left, as a check would find
    assert s.wait()[0] == 16 and s.gate.checks == 1
    assert s.gate.wait(StopFlag(install_signals=False), version=4)[0] == 20 and s.gate.checks == 1
    s.publish(1)                                  # LATEST moved back (a resumed trainer): the grant ends
    assert s.wait()[0] == 8 and s.gate.checks == 2   # limit 16 less the 8 unflushed trainable groups
    s.writer.close()


def other_writer_appends(tmp_path, n: int) -> ShardWriter:
    other = ShardWriter(tmp_path / "buffer", flush_groups=10_000, flush_seconds=10_000)
    for _ in range(n):                            # another generator's groups, visible at once
        other.append(make_group(0, [0.0, 1.0]))
    other.flush()
    return other


def test_while_another_writer_appends_a_grant_lives_poll_seconds(tmp_path):
    s = Setup(tmp_path, max_staleness=2, poll_seconds=3.0)   # ample for the next lines on a slow machine
    other = other_writer_appends(tmp_path, 5)
    assert s.wait()[0] == 7 and s.gate.checks == 1     # the first check sees the other writer's groups
    for _ in range(2):
        other.append(make_group(0, [0.0, 1.0]))
    other.flush()
    assert s.wait()[0] == 7 and s.gate.checks == 1     # within poll_seconds they go unseen
    time.sleep(3.1)
    assert s.wait()[0] == 5 and s.gate.checks == 2     # then a check sees them
    other.close()
    s.writer.close()


def test_a_lone_writers_grant_lives_longer(tmp_path):
    s = Setup(tmp_path, max_staleness=2, poll_seconds=0.5)
    s.gate.LONE_GRANT_POLLS = 4                        # 2 s; no other writer has appended
    assert s.wait()[0] == 12 and s.gate.checks == 1
    time.sleep(0.6)
    assert s.wait()[0] == 12 and s.gate.checks == 1    # older than poll_seconds, still spent
    time.sleep(1.5)
    assert s.wait()[0] == 12 and s.gate.checks == 2    # older than 4 poll_seconds: a check
    s.gate.OTHERS_WINDOW_S = 0.0                       # an old sighting of another writer ends at once
    other = other_writer_appends(tmp_path, 3)
    time.sleep(2.1)
    assert s.wait()[0] == 9 and s.gate.checks == 3     # the check sees them (2 s lone grant ended)
    other.close()
    s.writer.close()


def test_lockstep_checks_before_every_batch(tmp_path):
    s = Setup(tmp_path, max_staleness=0)            # limit at v0: 4
    assert s.wait()[0] == 4 and s.gate.checks == 1
    assert s.wait()[0] == 4 and s.gate.checks == 2
    s.append(1)
    assert s.wait()[0] == 3 and s.gate.checks == 3
    s.writer.close()


def test_unlimited_staleness_never_checks(tmp_path):
    s = Setup(tmp_path, max_staleness=2)
    s.gate.admission = Admission(max_staleness=None, groups_per_step=4)
    assert s.wait()[0] is None and s.gate.checks == 0
    s.writer.close()
