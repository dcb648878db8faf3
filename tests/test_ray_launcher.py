"""`asyncgrpo run --launcher ray`: the daemons as Ray actors, supervised as the local launcher's are.

The supervision policy is checked with fake daemons (no processes, exact counts); the
rest is one real run on a local Ray instance (this machine's CPUs), shared by the tests
below it because Ray's start-up and the daemons' take most of its time: 2 generators
train; a generator's daemon is killed -9 and restarted; another generator's Ray actor is
killed -9, its daemon dies with it and a new actor runs it; the trainer's daemon is killed
-9 and resumes; Ctrl-C stops everything and leaves no process behind; bench/chaos.py's SQL
invariants hold (nothing trained twice, nothing flushed lost, staleness within the limit).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from buffer import BufferSQL
from conftest import REPO, run_cli
from pipeline.children import DIE_WITH_PARENT_ENV
from pipeline.config import load_config
from pipeline.run import Supervisor
from test_run import metrics_steps, processes_of, start_run, wait_for
from workers.weights import WeightStore

sys.path.insert(0, str(REPO / "bench"))
from chaos import CHAOS_SETTINGS, Witness, invariants  # noqa: E402  (bench/ is scripts, not a package)

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install -e '.[ray]')")


# ---- the supervision policy, with fake daemons ----------------------------------------------------------------

@dataclass
class FakeDaemon:
    name: str
    argv: list[str]
    log_path: Path
    code: int | None = None
    started: list[list[str]] = field(default_factory=list)
    restarts: int = 0
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.started.append(list(self.argv))
        self.code = None

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.code = 0

    def kill(self) -> None:
        self.code = -9

    def wait(self, timeout: float | None) -> bool:
        return True


@dataclass
class FakeLauncher:
    name: str = "ray"
    trainer_ranks: int = 1
    max_trainer_restarts: int | None = 2
    resume_args: str = " --launcher ray"

    def open(self, echo) -> None:
        pass

    def daemon(self, role, index, name, argv, log_path) -> FakeDaemon:
        return FakeDaemon(name, argv, log_path)

    def close(self) -> None:
        pass


def _supervisor(tmp_path, launcher, *sets) -> Supervisor:
    cfg = load_config(None, ["run.restart_backoff_s=0.01", "run.num_generators=2", *sets])
    sup = Supervisor(tmp_path, cfg, resume=False, launcher=launcher)
    sup.start()
    return sup


def _crash_and_restart(sup: Supervisor, d: FakeDaemon) -> bool:
    """Crash `d`, let the backoff pass, and return check()'s verdict after the restart was due."""
    d.code = -9
    assert sup.check()                          # noticed: restart scheduled, not yet done
    time.sleep(0.01 * 2 ** d.restarts + 0.005)
    return sup.check()


def test_a_crashed_trainer_restarts_with_resume_up_to_its_limit(tmp_path):
    sup = _supervisor(tmp_path, FakeLauncher(max_trainer_restarts=2))
    t = sup.trainer
    assert t.started == [[sys.executable, "-m", "pipeline", "train", "--run", str(tmp_path)]]
    assert _crash_and_restart(sup, t) and _crash_and_restart(sup, t)
    assert t.restarts == 2 and t.exits == [-9, -9]
    assert t.started[1:] == [[sys.executable, "-m", "pipeline", "train", "--run", str(tmp_path), "--resume"]] * 2
    t.code = 1
    assert not sup.check()                      # the third crash is one too many
    assert sup.failure.startswith(f"trainer crashed 3 times (limit ray.max_trainer_restarts = 2); see "
                                  f"{tmp_path / 'logs' / 'trainer.log'}")
    assert sup.failure.endswith(f"Continue the run with: asyncgrpo run --resume --run {tmp_path} --launcher ray")


def test_the_trainer_finishing_ends_the_run_and_generators_restart_with_backoff(tmp_path):
    sup = _supervisor(tmp_path, FakeLauncher())
    g = sup.generators[1]
    assert g.argv[-4:] == ["--run", str(tmp_path), "--index", "1"]
    assert _crash_and_restart(sup, g) and g.restarts == 1 and len(g.started) == 2
    assert sup.generators[0].restarts == 0
    sup.trainer.code = 0
    assert not sup.check() and sup.failure is None


def test_the_local_launcher_still_stops_the_run_when_the_trainer_crashes(tmp_path):
    sup = _supervisor(tmp_path, FakeLauncher(name="local", max_trainer_restarts=0, resume_args=""))
    sup.trainer.code = -9
    assert not sup.check() and sup.trainer.started == [sup.trainer.argv]
    assert sup.failure.startswith("the trainer crashed (exit code -9); its log ends with:")
    assert sup.failure.endswith(f"Continue the run with: asyncgrpo run --resume --run {tmp_path}")


def test_several_trainer_ranks_run_under_torchrun(tmp_path):
    sup = _supervisor(tmp_path, FakeLauncher(trainer_ranks=2))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "pipeline", "train", "--run-dir", str(tmp_path)]
    assert sup.trainer.started == [torchrun]
    assert _crash_and_restart(sup, sup.trainer) and sup.trainer.started[1] == torchrun + ["--resume"]


def test_a_rank_in_a_session_of_its_own_dies_with_its_parent_when_asked():
    """As torchrun starts trainer ranks (start_new_session) inside a Ray actor: the parent's death kills them."""
    rank = ("from pipeline.children import die_with_parent_if_asked; die_with_parent_if_asked(); "
            "import time; time.sleep(60)")
    parent = ("import os, subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True, env=dict(os.environ, "
              f"{DIE_WITH_PARENT_ENV}='1')); print(p.pid, flush=True); time.sleep(1.5); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", parent], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    pid = int(out.stdout.split()[0])
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
             10, "the rank to die with its parent")


# ---- without Ray, and settings that cannot run ------------------------------------------------------------------

def test_ray_is_imported_only_by_the_ray_launcher():
    code = ("import sys, pathlib, pipeline.cli, pipeline.run, pipeline.ray_launcher, pipeline.config; "
            "pipeline.run.Supervisor(pathlib.Path('/nonexistent'), pipeline.config.load_config(), resume=False); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), check=True)
    assert out.stdout.strip() == "False"


def test_without_ray_the_launcher_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from pipeline.cli import main; "
            f"sys.argv = ['asyncgrpo', 'run', '--launcher', 'ray', '--run', {str(tmp_path / 'r')!r}]; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--launcher ray needs Ray" in out.stderr and "pip install -e '.[ray]'" in out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("key,value,need", [("generator_cpus", "-1", "ray.generator_cpus must be a number >= 0"),
                                            ("trainer_cpus", "0", "ray.trainer_cpus must be a number > 0"),
                                            ("trainer_gpus", "1.5", "ray.trainer_gpus must be a number >= 0, whole"),
                                            ("trainer_ranks", "0", "ray.trainer_ranks must be an integer >= 1")])
def test_bad_ray_settings_exit_2_naming_the_key(tmp_path, key, value, need):
    r = run_cli("run", "--launcher", "ray", "--run", str(tmp_path / "r"), "--set", f"ray.{key}={value}")
    assert r.returncode == 2 and need in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_help_says_where_the_run_directory_must_be():
    out = run_cli("run", "--help").stdout
    assert "--launcher [local|ray]" in out and "--address" in out and "shared filesystem" in out


def ray_processes() -> set[int]:
    """Live processes of any Ray instance on this machine (its servers, agents and workers)."""
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (cmd.startswith("ray::") or "/ray/core/src/ray/" in cmd or "/site-packages/ray/" in cmd):
            pids.add(int(d.name))
    return pids


@needs_ray
def test_more_gpus_than_the_local_instance_has_exit_2_naming_the_key(tmp_path):
    before = ray_processes()
    r = run_cli("run", "--launcher", "ray", "--run", str(tmp_path / "r"), "--set", "ray.trainer_gpus=1")
    assert r.returncode == 2, r.stderr
    assert "ray.trainer_gpus = 1 x 1 rank(s)" in r.stderr and "the local Ray instance has 0" in r.stderr
    assert not (tmp_path / "r").exists()        # refused before the model or the run directory
    assert not ray_processes() - before         # and the Ray instance it started is gone


# ---- one run on a local Ray instance ----------------------------------------------------------------------------

GENERATORS = 2
RAY_RUN = [*CHAOS_SETTINGS, f"run.num_generators={GENERATORS}", "ray.generator_cpus=0.5", "run.eval_size=20",
           "run.restart_backoff_s=0.5"]
MIN_STEPS = 6


def daemons(run: Path, command: str) -> list[int]:
    """Live processes of the run whose argv holds `command` (train, generate, compactor) as a word."""
    out = []
    for pid in processes_of(run):
        try:
            if command in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"):
                out.append(pid)
        except OSError:
            continue
    return out


def argv_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def index_of(pid: int) -> str | None:
    """The --index of a generator process."""
    argv = argv_of(pid)
    return argv[argv.index("--index") + 1] if "--index" in argv else None


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def resumed_step(run: Path) -> int | None:
    """The step a resumed trainer continues from (its log's 'trainer at step k, ... (resumed'), once it says so."""
    found = re.findall(r"trainer at step (\d+), version \d+ \(resumed", (run / "logs" / "trainer.log").read_text())
    return int(found[-1]) if found else None


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """The run, its kills and its Ctrl-C; what was seen, for the tests to check."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    run = tmp_path_factory.mktemp("ray") / "r"
    ray_before = ray_processes()
    started = time.time()
    p = start_run(run, *RAY_RUN, options=("--launcher", "ray"))
    seen = Witness(run)
    facts: dict = {"run": run}
    try:
        wait_for(lambda: metrics_steps(run) >= 1 or p.poll() is not None, 300, "the first trainer step")
        facts["seconds_to_first_step"] = time.time() - started
        wait_for(lambda: metrics_steps(run) >= 2 or p.poll() is not None, 120, "two trainer steps")
        assert p.poll() is None, p.communicate()[0]
        facts["generators_at_start"] = gens = daemons(run, "generate")
        seen.look()
        os.kill(gens[0], signal.SIGKILL)
        facts["generator_restarted"] = wait_for(lambda: [q for q in daemons(run, "generate") if q not in gens],
                                                60, "the generator to be restarted")
        # kill -9 of generator-1's Ray actor (the parent of its daemon): the daemon dies with it, a new actor
        # runs it anew
        daemon = next(q for q in daemons(run, "generate") if index_of(q) == "1")
        seen.look()
        os.kill(parent_of(daemon), signal.SIGKILL)
        wait_for(lambda: not alive(daemon), 5, "generator-1's daemon to die with its actor")
        facts["actor_replaced"] = wait_for(lambda: [q for q in daemons(run, "generate") if index_of(q) == "1"
                                                    and q != daemon], 60, "generator-1 to run in a new actor")
        facts["trainer_at_start"] = trainers = daemons(run, "train")
        seen.look()
        os.kill(trainers[0], signal.SIGKILL)
        facts["trainer_resumed"] = wait_for(lambda: [q for q in daemons(run, "train") if q not in trainers
                                                     and "--resume" in argv_of(q)], 60, "the trainer to resume")
        resumed_at = wait_for(lambda: resumed_step(run), 120, "the resumed trainer to open its checkpoint")
        wait_for(lambda: metrics_steps(run) >= max(resumed_at + 2, MIN_STEPS), 240, "two steps after the resume")
        seen.look()
    except Exception as e:  # noqa: BLE001 - every test below reports it, with the run's output
        facts["error"] = f"{type(e).__name__}: {e}"
    finally:
        p.send_signal(signal.SIGINT)              # Ctrl-C
        facts["out"], _ = p.communicate(timeout=240)
    facts["returncode"] = p.returncode
    facts["seconds"] = time.time() - started
    facts["left_behind"] = processes_of(run)
    facts["ray_left_behind"] = ray_processes() - ray_before
    facts["seen"] = seen.seen
    return facts


def completed(ray_run) -> dict:
    """The run's facts, once it is known to have gone as planned and stopped with exit code 0."""
    logs = ray_run["run"] / "logs"
    tails = "".join(f"\n--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
                    for f in sorted(logs.glob("*.log"))) if logs.is_dir() else ""
    assert "error" not in ray_run and ray_run["returncode"] == 0, \
        f"{ray_run.get('error')}; exit code {ray_run['returncode']}\n{ray_run['out'][-4000:]}{tails}"
    return ray_run


@needs_ray
def test_ray_run_trains_with_two_generators_and_reuses_the_display(ray_run):
    out, run = completed(ray_run)["out"], ray_run["run"]
    assert len(ray_run["generators_at_start"]) == GENERATORS and len(ray_run["trainer_at_start"]) == 1
    assert "Ray: a local Ray instance, 1 node(s)" in out
    assert "stopping (SIGINT)" in out and "greedy accuracy on 20 held-out prompts: before" in out
    assert "asyncgrpo sql" in out
    s = json.loads((run / "run.json").read_text())["summary"]
    assert s["launcher"] == "ray" and s["stopped_by"] == "SIGINT" and s["step"] >= MIN_STEPS
    ids = BufferSQL(run).query("SELECT DISTINCT generator_id FROM rollouts ORDER BY 1").column(0).to_pylist()
    assert ids == ["gen0", "gen1"]
    logs = sorted(p.name for p in (run / "logs").iterdir())
    assert logs == ["compactor.log", "generator-0.log", "generator-1.log", "trainer.log"]


@needs_ray
def test_killed_generator_restarts_and_killed_trainer_resumes(ray_run):
    run, out = completed(ray_run)["run"], ray_run["out"]
    assert "generator-0 exited with code -9; restarting" in out or "generator-1 exited with code -9; restarting" in out
    assert "trainer exited with code -9; restarting" in out
    assert "generator-1's Ray actor died" in out and "generator-1 exited with code -1; restarting" in out
    assert "the Ray actor running generator-1 ended" in (run / "logs" / "generator-1.log").read_text()
    s = json.loads((run / "run.json").read_text())["summary"]
    assert s["generator_restarts"] >= 2 and s["trainer_restarts"] >= 1
    assert "(resumed, online)" in (run / "logs" / "trainer.log").read_text()


@needs_ray
def test_sql_invariants_hold_after_the_kills(ray_run):
    run = completed(ray_run)["run"]
    steps = BufferSQL(run).query("SELECT max(trainer_step) s FROM consumed").to_pylist()[0]["s"]
    assert steps >= MIN_STEPS and WeightStore(run / "weights").latest() == steps
    figures = invariants(run, ray_run["seen"], max_steps=steps, groups_per_step=8, max_staleness=2)
    print(f"ray run: {ray_run['seconds']:.0f} s in all, first step after {ray_run['seconds_to_first_step']:.0f} s, "
          f"{steps} steps; {figures}")
    assert figures["ok"], figures
    assert figures["groups_seen_before_kills"] > 0 and figures["staleness_max"] <= 2


@needs_ray
def test_ctrl_c_leaves_no_process_behind(ray_run):
    completed(ray_run)
    assert not ray_run["left_behind"], "daemons outlived the run"
    assert not ray_run["ray_left_behind"], "Ray processes outlived the run"
    assert any((ray_run["run"] / "checkpoints").iterdir())
