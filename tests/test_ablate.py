"""`asyncgrpo ablate` end to end on the tiny model, replay without a generator, lockstep at staleness 0,
and the admission rule's exact counts.

One two-cell sweep (staleness 0 and 2, 3 steps each) is shared by the tests that read its outputs;
the warm-started model is cached in runs/.cache as for `make run`.
"""

from __future__ import annotations

import csv
import json
import threading
import time
from pathlib import Path

import pytest

from buffer import BufferSQL, GroupIndex, Sampler, ShardWriter
from conftest import CACHE, make_group, run_cli

GPS = 4  # groups per step
SMALL = [f"model.cache_dir={CACHE}", "trainer.max_steps=3", "run.time_limit_s=none", "run.eval_size=20",
         f"trainer.groups_per_step={GPS}", "generator.prompts_per_batch=8", "generator.num_generations=4",
         # A pending group reaches the trainer only by a flush: with 120 s, a lockstep step that waited
         # for the flush timer (rather than the flush before the generator waits) would take > 120 s.
         "generator.flush_seconds=120"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def q(run: Path, sql: str) -> list[dict]:
    return BufferSQL(run).query(sql).to_pylist()


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, list[str], str]:
    out = tmp_path_factory.mktemp("ablate") / "out"
    args = ["ablate", "--staleness", "0,2", "--is-mode", "decoupled", "--seeds", "1", "--eval-every", "1",
            "--out", str(out), *sets(*SMALL)]
    r = run_cli(*args, timeout=1200)   # ~100 s on 2 idle cores; a loaded CI machine took > 400 s
    assert r.returncode == 0, r.stdout + r.stderr
    return out, args, r.stdout


def test_two_cell_sweep_writes_csv_table_and_plot(sweep):
    out, _, stdout = sweep
    rows = read_csv(out / "ablation.csv")
    assert [(r["cell"], r["staleness"], r["is_mode"], r["seed"], r["steps"]) for r in rows] == [
        ("s0-decoupled-seed1", "0", "decoupled", "1", "3"), ("s2-decoupled-seed1", "2", "decoupled", "1", "3")]
    for r in rows:
        assert 0 <= float(r["final_accuracy"]) <= 1 and float(r["steps_per_s"]) > 0
        assert 0 <= float(r["trainer_idle_share"]) <= 1 and 0 <= float(r["generator_idle_share"]) <= 1
        assert 0 < float(r["filtered_frac"]) < 1
        assert float(r["target_accuracy"]) == pytest.approx(float(r["accuracy_before"]) + 0.10)
    # At staleness 2 a batch sized by the trainable share may overshoot the admission limit by a group
    # or two, which can wait past the limit (README, "Expired"): whether one does depends on timing, so
    # the fraction is checked against the cell's own buffer, not against 0. (Lockstep: its own test.)
    s2 = out / "cells" / "s2-decoupled-seed1"
    expired = q(s2, "SELECT count(*) n FROM groups "
                    "WHERE NOT filtered AND times_consumed = 0 AND version < 3 - 2")[0]["n"]
    groups = q(s2, "SELECT count(*) n FROM groups")[0]["n"]
    assert float(rows[1]["expired_frac"]) == pytest.approx(expired / groups)
    assert float(rows[1]["expired_frac"]) < 0.25
    assert float(rows[0]["mean_staleness"]) == 0.0 and 0 <= float(rows[1]["mean_staleness"]) <= 2
    md = (out / "ablation.md").read_text()
    assert ("| staleness | IS mode | seed | final greedy acc | time to target (s) | steps/s | mean staleness "
            "| expired | filtered | trainer idle | generator idle |") in md
    assert md.count("| 0 | decoupled | 1 |") == 1 and md.count("| 2 | decoupled | 1 |") == 1
    assert "## Mean over seeds" in md
    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    curves = read_csv(out / "curves.csv")
    for cell in ("s0-decoupled-seed1", "s2-decoupled-seed1"):   # every version kept with --eval-every 1
        assert [int(p["step"]) for p in curves if p["cell"] == cell] == [0, 1, 2, 3]
    assert "[2/2] s2-decoupled-seed1: running" in stdout


def test_lockstep_at_staleness_0_trains_on_fresh_groups_without_crawling(sweep):
    out, _, _ = sweep
    run = out / "cells" / "s0-decoupled-seed1"
    assert q(run, "SELECT staleness, count(*) n FROM consumed GROUP BY 1") == [{"staleness": 0, "n": 3 * GPS}]
    # The generator samples version v only until the step has its groups; trainable groups beyond the
    # step's need (the rest of the batch that filled it) are kept in the buffer, counted as surplus,
    # and expire: exactly the unconsumed trainable groups of the versions the trainer has passed.
    per_version = q(run, "SELECT version, count(*) n, sum(times_consumed) c FROM groups WHERE NOT filtered "
                         "GROUP BY 1 ORDER BY 1")
    assert [(x["n"] >= GPS, x["c"]) for x in per_version if x["version"] < 3] == [(True, GPS)] * 3
    surplus = int(q(run, "SELECT sum(surplus_groups) n FROM generator_metrics WHERE version < 3")[0]["n"])
    assert surplus == sum(x["n"] - GPS for x in per_version if x["version"] < 3)
    row = read_csv(out / "ablation.csv")[0]
    groups = q(run, "SELECT count(*) n FROM groups")[0]["n"]
    assert float(row["expired_frac"]) == pytest.approx(surplus / groups)
    # Steps after the first (which waits for the generator to start) never wait for the 120 s flush timer.
    waits = [x["w"] for x in q(run, 'SELECT "time/wait_s" w FROM metrics WHERE step > 1')]
    assert len(waits) == 2 and max(waits) < 60, waits
    idle = q(run, "SELECT sum(wait_s) / sum(seconds) idle, count(*) n, min(rss_mb) rss FROM generator_metrics")[0]
    assert 0 < idle["idle"] < 1 and idle["n"] >= 4   # start-up row + at least one batch a step
    assert idle["rss"] > 100                         # the generator's resident memory, torch and model loaded


def test_rerun_skips_finished_cells(sweep):
    out, args, _ = sweep
    before = (out / "ablation.csv").read_text()
    t0 = time.time()
    r = run_cli(*args, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("finished earlier: skipped") == 2 and "running" not in r.stdout
    assert (out / "ablation.csv").read_text() == before
    assert time.time() - t0 < 60
    r = run_cli(*args, "--set", "trainer.lr=2e-4", timeout=120)   # another config: not silently mixed in
    assert r.returncode == 2 and "trainer.lr = 0.0001, this sweep has 0.0002" in r.stderr, r.stderr


def test_replay_trains_on_a_stored_buffer_without_a_generator(sweep, tmp_path):
    out, _, _ = sweep
    source = out / "cells" / "s2-decoupled-seed1"
    source_ledger = q(source, "SELECT count(*) n FROM consumed")
    r = run_cli("ablate", "--staleness", "1", "--is-mode", "none", "--seeds", "1", "--eval-every", "1",
                "--replay", str(source), "--out", str(tmp_path / "replay"),
                *sets(*SMALL, "trainer.max_steps=2"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    cell = tmp_path / "replay" / "cells" / "s1-none-seed1"
    assert not (cell / "generator_metrics").exists() and not (cell / "logs").exists()
    assert sorted(p.name for p in (cell / "buffer" / "shards").iterdir()) == \
        sorted(p.name for p in (source / "buffer" / "shards").iterdir())   # nothing generated
    consumed = q(cell, "SELECT trainer_step, staleness FROM consumed")
    assert len(consumed) == 2 * GPS and all(0 <= x["staleness"] <= 1 for x in consumed)
    assert q(cell, "SELECT count(*) n FROM metrics") == [{"n": 2}]
    assert q(source, "SELECT count(*) n FROM consumed") == source_ledger   # the source is untouched
    row = read_csv(tmp_path / "replay" / "ablation.csv")[0]
    assert row["replay"] == str(source) and row["generator_idle_share"] == "" and row["steps"] == "2"
    info = json.loads((cell / "run.json").read_text())
    assert info["initial_model"] == json.loads((source / "run.json").read_text())["initial_model"]


def test_bad_options_are_user_errors(tmp_path):
    r = run_cli("ablate", "--staleness", "0,x", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "--staleness: 'x' is not an integer >= 0" in r.stderr
    r = run_cli("ablate", "--seeds", "1", "--out", str(tmp_path / "b"),
                *sets("trainer.max_steps=none", "run.time_limit_s=none"))
    assert r.returncode == 2 and "trainer.max_steps or run.time_limit_s" in r.stderr
    r = run_cli("ablate", "--sweep", "trainer.max_staleness=1,2", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "use --staleness" in r.stderr
    r = run_cli("ablate", "--sweep", "trainer.lrr=1,2", "--seeds", "1", "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and "trainer.lrr" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "d" / "cells").exists()


def test_cell_state_tells_finished_from_half_finished(tmp_path):
    from pipeline.ablate.cell import cell_state
    from pipeline.rundir import write_run_info

    run = tmp_path / "cell"
    assert cell_state(run) == "redo"
    run.mkdir()
    write_run_info(run, {"initial_model": "m", "eval_before": 0.2})            # killed while training
    assert cell_state(run) == "redo"
    write_run_info(run, {"summary": {"stopped_by": "SIGINT"}})                 # Ctrl-C'd: cut short
    assert cell_state(run) == "redo"
    write_run_info(run, {"summary": {"stopped_by": "time limit"}})             # ran, not yet evaluated
    assert cell_state(run) == "ran"
    (run / "cell.json").write_text("{}")
    assert cell_state(run) == "done"


# -- the admission rule, with exact counts -------------------------------------------------------------
class _Store:
    def __init__(self, v: int):
        self.v = v

    def latest(self) -> int:
        return self.v


class _NoStats:
    def flush_if_due(self) -> None:
        pass


def _admit(buf: Path, writer, trainable, t: int, max_staleness: int, stop=None):
    """A fresh gate's first answer: always a check (tests/test_generator_admission.py covers its reuse)."""
    from workers.generator import Admission, AdmissionGate, GeneratorConfig
    from workers.stop import StopFlag

    gate = AdmissionGate(GroupIndex(buf), writer, trainable, Admission(max_staleness, 2), _Store(t),
                         GeneratorConfig(poll_seconds=0.01), _NoStats())
    return gate.wait(stop if stop is not None else StopFlag(install_signals=False))


def test_admission_counts_neither_filtered_nor_expired_groups(buf):
    from workers.generator import TrainableShare

    trainable = TrainableShare()
    with ShardWriter(buf, flush_groups=100) as w:
        for i in range(3):                                   # 3 trainable groups of v0
            w.append(make_group(0, [0.0, 1.0], prompt_id=f"a{i}", seed=i))
        for i in range(5):                                   # 5 filtered ones
            w.append(make_group(0, [1.0, 1.0], prompt_id=f"f{i}", seed=10 + i))
    with Sampler(buf) as s:                                  # the step at v0 took 2 of them
        assert s.pull(2, trainer_version=0, trainer_step=1, max_staleness=0) is not None
    # At v1, staleness 0, 2 groups a step: limit (0 + 1 + 1) * 2 = 4. Admitted: 2 consumed; the third
    # v0 group expired and the 5 filtered ones never count, so 2 more may come.
    writer = ShardWriter(buf, flush_groups=100, flush_seconds=None)
    assert _admit(buf, writer, trainable, t=1, max_staleness=0)[0] == 2
    # Unflushed groups count when trainable (the newest appended ones), not when filtered.
    writer.append(make_group(1, [1.0, 1.0], prompt_id="pf", seed=20))
    trainable.appended(False)
    writer.append(make_group(1, [0.0, 1.0], prompt_id="pt", seed=21))
    trainable.appended(True)
    assert _admit(buf, writer, trainable, t=1, max_staleness=0)[0] == 1
    # At the limit the generator writes its pending groups before it waits (the trainer needs them).
    writer.append(make_group(1, [0.0, 1.0], prompt_id="pt2", seed=22))
    trainable.appended(True)
    from workers.stop import StopFlag

    stop = StopFlag(install_signals=False)
    wait = stop.wait

    def wait_then_stop(seconds=None):     # the stop comes 0.5 s after the admission's first wait began
        if not timers:
            timers.append(threading.Timer(0.5, stop.set))
            timers[0].start()
        return wait(seconds)

    timers = []
    stop.wait = wait_then_stop
    allowance, waited = _admit(buf, writer, trainable, t=1, max_staleness=0, stop=stop)
    assert allowance == 0 and waited >= 0.45 and writer.pending_groups == 0   # 0.5 s, less clock rounding
    assert len(GroupIndex(buf)) == 3 + 5 + 3
    # Staleness 2 at v1: limit (2 + 1 + 1) * 2 = 8; admitted 2 consumed + 1 v0 (not expired) + 2 of v1.
    assert _admit(buf, writer, trainable, t=1, max_staleness=2)[0] == 3


def test_admission_counts_shards_in_flight_without_waiting_for_them(buf, monkeypatch):
    import buffer.writer as writer_module
    from workers.generator import TrainableShare

    release = threading.Event()
    write = writer_module._write_buffer

    def held(f, data):              # the shard's write waits until the test lets it go
        release.wait(30)
        write(f, data)

    monkeypatch.setattr(writer_module, "_write_buffer", held)
    trainable = TrainableShare()
    writer = ShardWriter(buf, flush_groups=2, flush_seconds=None)
    try:
        for i in range(2):          # 2 trainable groups of v0 fill a shard, which stays in flight
            writer.append(make_group(0, [0.0, 1.0], prompt_id=f"a{i}", seed=i))
            trainable.appended(True)
        # Staleness 2 at v0: limit (2 + 0 + 1) * 2 = 6; admitted: the 2 groups in flight.
        t0 = time.monotonic()
        assert _admit(buf, writer, trainable, t=0, max_staleness=2)[0] == 4
        assert time.monotonic() - t0 < 10 and writer.pending_groups == 2   # it did not wait for the shard
        release.set()
        writer.wait()
        assert writer.pending_groups == 0 and len(GroupIndex(buf)) == 2
        assert _admit(buf, writer, trainable, t=0, max_staleness=2)[0] == 4   # now the index counts them, once
    finally:
        release.set()
        writer.close()


def test_batches_are_sized_by_the_trainable_share():
    from workers.generator import GeneratorConfig, TrainableShare, _batch_size

    cfg = GeneratorConfig(prompts_per_batch=32)
    share = TrainableShare()
    assert _batch_size(cfg, 32, share) == 32     # no history: no over-sampling
    for keep in [True, False, False, True]:       # half are trainable
        share.record(keep)
    assert _batch_size(cfg, 10, share) == 20     # 10 / 0.5
    assert _batch_size(cfg, 3, share) == 6
    assert _batch_size(cfg, 30, share) == 32     # at most a batch
    for _ in range(60):                           # 2 of 64 trainable: the share is floored at 1/8
        share.record(False)
    assert _batch_size(cfg, 2, share) == 16
    assert _batch_size(cfg, None, share) == 32   # no limit: a whole batch
