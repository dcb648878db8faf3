"""Chaos harness: kill -9 generators, the trainer and the compactor at random moments during a real run; lose nothing.

    nice python bench/chaos.py [--kills 100] [--generators 2] [--max-steps 250] [--interval 1 4]
                               [--run runs/chaos] [--seed 0] [--set KEY=VALUE ...]

A run of the embedded tiny model on the arithmetic task (the default config with
smaller steps: 8 groups a step, a checkpoint every 2 steps, shards every 8 groups
or 1 s; the compactor merges sealed shards every 1 s) is driven daemon by daemon,
as `asyncgrpo run` starts them: `asyncgrpo train --run R --resume`,
`asyncgrpo generate --run R --index i` and `asyncgrpo compactor --run R`.
Every `--interval` seconds (uniform between the two bounds) a victim is chosen:
the trainer, one generator, the compactor, or everything at once ("power cut"). Before the kill
the harness records every group the buffer shows (a `GroupIndex` that never
moves files) and runs a SQL query; then SIGKILL, and the victim is restarted at
once (the trainer with --resume). A daemon that dies by itself is restarted too
and counted. Until the last kill the trainer has no step limit, so a fast machine
cannot finish the run before every kill has landed; the last kill always hits the
trainer (alone or with everything), which then resumes with its final limit:
max(--max-steps, the step it resumed from + 3). The run must reach that step.

Then, with SQL over the run (`buffer.BufferSQL`, the views `asyncgrpo sql` has):
    no group trained twice            consumed has one row per group_id
    steps complete and contiguous     trainer steps 1..max_steps, groups_per_step groups each
    no flushed group lost             every group seen before any kill is still in `groups`
    nothing quarantined               no kill left a partial file that readers refused
    staleness within the limit        trainer_version - version <= max_staleness for every consumed group
    consumed groups exist             every ledger group_id is in `rollouts`, none filtered
    metrics exact                     one metrics row per step 1..max_steps
    weights published                 LATEST names max_steps and its folder has model.safetensors
    run completed                     the trainer exited 0 at max_steps

The last line on stdout is one JSON object with the figures; the exit code is 0
only if every invariant holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# A victim still starting up (no step / no weights loaded yet since its restart) is spared with this
# probability, so most kills hit working daemons and some hit start-up and the resume's rollback.
STARTUP_SPARE = 0.9
UNLIMITED_STEPS = 10 ** 9   # the trainer's step limit until the last kill

# Smaller steps than the default run, so that a few seconds between kills still see
# steps, checkpoints, publications and shard flushes happen (and get interrupted).
CHAOS_SETTINGS = [
    "trainer.groups_per_step=8", "trainer.checkpoint_every=2", "trainer.num_threads=1",
    "trainer.metrics_flush_seconds=1.0", "trainer.poll_seconds=0.1", "trainer.log_wait_seconds=10",
    "generator.prompts_per_batch=8", "generator.flush_groups=8", "generator.flush_seconds=1.0",
    "generator.num_threads=1", "generator.poll_seconds=0.1", "generator.log_every_seconds=30",
    "compactor.every_s=1.0", "compactor.min_age_s=2.0", "compactor.grace_s=3.0", "run.time_limit_s=none",
]


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Daemon:
    """One daemon process of the run, started as `python -m pipeline <args>`."""

    name: str
    args: list[str]
    log_path: Path
    ready_mark: str = ""
    """A log line the daemon writes once it works (not just starts): a step, loaded weights."""
    proc: subprocess.Popen | None = None
    log_offset: int = 0
    starts: int = 0
    kills: int = 0
    own_exits: list[int] = field(default_factory=list)   # exit codes of deaths the harness did not cause

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", *self.args], cwd=REPO,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                                                  OMP_NUM_THREADS="1"))
        self.starts += 1

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def working(self) -> bool:
        """Whether this life of the daemon has written its ready mark (it got past start-up)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return self.ready_mark.encode() in f.read()
        except OSError:
            return False

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.kills += 1

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (generators flush, the trainer checkpoints), then wait; kill -9 after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def prepare_run(run: Path, settings: list[str]) -> dict:
    """A fresh run directory as `asyncgrpo run` leaves it before starting daemons: config.toml, run.json."""
    import shutil

    from pipeline.config import load_config, save_config
    from pipeline.rundir import prepare_model, write_run_info

    cfg = load_config(REPO / "configs" / "default.toml", settings)
    model = prepare_model(cfg, echo=log)
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    save_config(cfg, run / "config.toml")
    write_run_info(run, {"initial_model": str(model.resolve()), "eval_before": None})
    return {"max_steps": cfg.trainer.max_steps, "groups_per_step": cfg.trainer.groups_per_step,
            "max_staleness": cfg.trainer.max_staleness}


class Witness:
    """What the buffer shows between kills: every group id ever seen, and SQL queries that must succeed."""

    def __init__(self, run: Path):
        self.run = run
        self.index = None
        self.seen: set[str] = set()
        self.queries = 0
        self.query_errors: list[str] = []

    def look(self) -> int:
        """Record the groups now visible (read-only: never quarantines); returns how many."""
        from buffer import BufferDir, GroupIndex

        if self.index is None:
            if not BufferDir.is_buffer(self.run / "buffer"):
                return 0
            self.index = GroupIndex(self.run / "buffer", quarantine=False)
        self.index.refresh()
        self.seen.update(self.index.group_ids)
        return len(self.index.group_ids)

    def query(self) -> None:
        """A query over every view while daemons die around it; any error is a finding."""
        from buffer import BufferDir, BufferSQL

        if not BufferDir.is_buffer(self.run / "buffer"):
            return
        self.queries += 1
        try:
            BufferSQL(self.run, quarantine=False).query(
                "SELECT (SELECT count(*) FROM groups) g, (SELECT count(*) FROM consumed) c, "
                "(SELECT count(*) FROM quarantined) q")
        except Exception as e:  # noqa: BLE001 - recorded and reported
            self.query_errors.append(f"{type(e).__name__}: {e}"[:300])


def invariants(run: Path, seen: set[str], *, max_steps: int, groups_per_step: int,
               max_staleness: int | None) -> dict:
    """The checks of the module doc, as named figures; `ok` is their conjunction."""
    from buffer import BufferSQL
    from workers.weights import WeightStore

    db = BufferSQL(run, quarantine=False)

    def one(sql: str):
        return db.query(sql).to_pylist()[0]

    steps = db.query("SELECT trainer_step s, count(*) n FROM consumed GROUP BY 1 ORDER BY 1").to_pylist()
    present = set(db.query("SELECT group_id FROM groups").column("group_id").to_pylist())
    limit = max_staleness if max_staleness is not None else 2 ** 62
    store = WeightStore(run / "weights")
    latest = store.latest()
    metrics = db.query("SELECT step, count(*) n FROM metrics GROUP BY 1 ORDER BY 1").to_pylist()
    out = {
        "groups_in_buffer": len(present),
        "groups_consumed": one("SELECT count(*) n FROM consumed")["n"],
        "groups_trained_twice": one("SELECT count(*) n FROM (SELECT group_id FROM consumed "
                                    "GROUP BY 1 HAVING count(*) > 1)")["n"],
        "steps_recorded": len(steps),
        "steps_wrong": sum(1 for i, r in enumerate(steps) if r["s"] != i + 1 or r["n"] != groups_per_step)
                       + abs(len(steps) - max_steps),
        "groups_seen_before_kills": len(seen),
        "flushed_groups_lost": len(seen - present),
        "quarantined": one("SELECT count(*) n FROM quarantined")["n"],
        "staleness_max": one("SELECT max(staleness) s FROM consumed")["s"],
        "over_staleness_limit": one(
            f"SELECT count(*) n FROM consumed c JOIN groups g USING (group_id) "
            f"WHERE c.trainer_version - g.version > {limit} OR c.staleness <> c.trainer_version - g.version")["n"],
        "consumed_missing_or_filtered": one(
            "SELECT count(*) n FROM consumed c LEFT JOIN groups g USING (group_id) "
            "WHERE g.group_id IS NULL OR g.filtered")["n"],
        "metrics_rows_wrong": sum(1 for i, r in enumerate(metrics) if r["step"] != i + 1 or r["n"] != 1)
                              + abs(len(metrics) - max_steps),
        "latest_version": latest,
        "latest_complete": latest is not None and (store.folder(latest) / "model.safetensors").is_file(),
        "abandoned_ledger_shards": len(list((run / "buffer" / "ledger" / "abandoned").glob("*.parquet"))),
    }
    out["ok"] = (out["groups_trained_twice"] == 0 and out["steps_wrong"] == 0 and out["flushed_groups_lost"] == 0
                 and out["quarantined"] == 0 and out["over_staleness_limit"] == 0
                 and out["consumed_missing_or_filtered"] == 0 and out["metrics_rows_wrong"] == 0
                 and out["latest_version"] == max_steps and out["latest_complete"])
    return out


def chaos(run: Path, *, kills: int, generators: int, interval: tuple[float, float], seed: int,
          settings: list[str], timeout_s: float) -> dict:
    rng = random.Random(seed)
    shape = prepare_run(run, settings)
    max_steps = shape["max_steps"]
    if max_steps is None:
        raise SystemExit("set trainer.max_steps: the run must end for its completion to be checked")
    if kills < 1:
        raise SystemExit("--kills must be at least 1")
    trainer_args = ["train", "--run", str(run), "--resume", "--set"]
    trainer = Daemon("trainer", [*trainer_args, f"trainer.max_steps={UNLIMITED_STEPS}"],
                     run / "logs" / "trainer.log", ready_mark=" | loss ")
    gens = [Daemon(f"generator-{i}", ["generate", "--run", str(run), "--index", str(i)],
                   run / "logs" / f"generator-{i}.log", ready_mark="loaded weights") for i in range(generators)]
    compactor = Daemon("compactor", ["compactor", "--run", str(run)], run / "logs" / "compactor.log",
                       ready_mark="compacting")
    daemons = [trainer, *gens, compactor]
    witness = Witness(run)
    events = {"trainer": 0, "generator": 0, "compactor": 0, "all": 0}
    processes_killed = in_startup = 0
    trainer_code = None
    started = time.time()
    # A SIGTERM to the harness still stops its daemons (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"chaos: stopped by SIGTERM after {sum(events.values())} kills"))
    for d in daemons:
        d.start()
    next_kill = started + rng.uniform(*interval)
    try:
        while True:
            time.sleep(0.2)
            code = trainer.poll()
            if code == 0:
                trainer_code = 0
                break
            for d in daemons:   # deaths the harness did not cause: restart and count
                c = d.poll()
                if c is not None:
                    d.own_exits.append(c)
                    log(f"{d.name} exited by itself with code {c}; restarting (see {d.log_path})")
                    d.start()
            if time.time() - started > timeout_s:
                log(f"timed out after {timeout_s:.0f} s")
                break
            if sum(events.values()) >= kills or time.time() < next_kill:
                continue
            last = sum(events.values()) == kills - 1
            kind = (rng.choices(["trainer", "all"], weights=[0.75, 0.25]) if last else
                    rng.choices(["trainer", "generator", "compactor", "all"], weights=[0.3, 0.45, 0.15, 0.1]))[0]
            victims = {"trainer": [trainer], "generator": [rng.choice(gens)], "compactor": [compactor],
                       "all": daemons}[kind]
            if not all(d.working() for d in victims) and rng.random() < STARTUP_SPARE:
                next_kill = time.time() + 1.0   # mostly kill daemons at work; some kills land in start-up
                continue
            witness.look()
            witness.query()
            in_startup += not all(d.working() for d in victims)
            for d in victims:
                if d.poll() is None:
                    d.kill9()
                    processes_killed += 1
            events[kind] += 1
            if last:    # the trainer is dead: its newest checkpoint is where it resumes
                shape["max_steps"] = max(max_steps, (_step(run) or 0) + 3)
                trainer.args = [*trainer_args, f"trainer.max_steps={shape['max_steps']}"]
                log(f"last kill: the trainer resumes to finish at step {shape['max_steps']}")
            for d in victims:
                d.start()
            witness.query()
            n = sum(events.values())
            if n % 10 == 0:
                log(f"{n} kills ({events}); {len(witness.seen)} groups seen; step {_step(run)}")
            next_kill = time.time() + rng.uniform(*interval)
    finally:
        for d in [*gens, compactor]:
            d.stop()
        if trainer_code is None:
            trainer.stop()
    figures = invariants(run, witness.seen, **shape)
    figures.update({
        "kills": sum(events.values()), "kills_of_trainer": events["trainer"],
        "kills_of_a_generator": events["generator"], "kills_of_compactor": events["compactor"],
        "kills_of_all": events["all"], "processes_killed": processes_killed, "kills_in_startup": in_startup,
        "own_exits": {d.name: d.own_exits for d in daemons if d.own_exits},
        "queries_during_faults": witness.queries, "query_errors": len(witness.query_errors),
        "trainer_exit": trainer_code, "max_steps": shape["max_steps"], "seconds": round(time.time() - started, 1),
    })
    figures["ok"] = figures["ok"] and trainer_code == 0 and not witness.query_errors
    for e in witness.query_errors[:5]:
        log(f"query error: {e}")
    return figures


def _step(run: Path) -> int | None:
    from workers.trainer.checkpoint import list_checkpoints

    cps = list_checkpoints(run / "checkpoints")
    return cps[-1][0] if cps else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "runs" / "chaos", help="Run directory (deleted first).")
    p.add_argument("--kills", type=int, default=100, help="Kill events (trainer, a generator, the compactor, or all).")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=250, help="trainer.max_steps: the run ends at max(this, "
                   "the step the last kill rolled the trainer back to + 3).")
    p.add_argument("--interval", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"),
                   help="Seconds between kills, uniform in [MIN, MAX].")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="Give up (and fail) after this many seconds.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="More config overrides, e.g. --set model.cache_dir=/tmp/cache.")
    args = p.parse_args()
    settings = CHAOS_SETTINGS + [f"trainer.max_steps={args.max_steps}",
                                 f"run.num_generators={args.generators}"] + args.overrides
    figures = chaos(args.run.absolute(), kills=args.kills, generators=args.generators,
                    interval=tuple(args.interval), seed=args.seed, settings=settings, timeout_s=args.timeout)
    print(json.dumps(figures), flush=True)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
