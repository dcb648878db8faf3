"""`asyncgrpo run --launcher ray`: the daemons as Ray actors, on a laptop or a cluster.

    connect: --address (or $RAY_ADDRESS) joins a running Ray cluster; without it a local
        Ray instance is started with this machine's CPUs, and stopped when the run ends
    check: what the [ray] section asks fits the cluster (an error on the local instance;
        a warning on a cluster, whose autoscaler may still add nodes)
    place: the trainer in a placement group (ray.trainer_ranks x the per-rank CPUs and GPUs,
        one node, reserved across its restarts); each generator and the compactor as an actor
        with its CPUs and GPUs
    run: each actor runs its daemon's command (`asyncgrpo train` under torchrun when
        trainer_ranks > 1, `asyncgrpo generate`, `asyncgrpo compactor`: what the local launcher
        runs) as a subprocess in a process group of its own, output appended to
        <run>/logs/<name>.log; the subprocess is killed if its actor dies
    supervise: pipeline.run's Supervisor, as locally (restarts with backoff, display,
        summary); a crashed trainer is restarted with --resume; an actor that died is made anew
    stop: SIGTERM to each subprocess through its actor, wait (generators flush, the trainer
        checkpoints); then kill the actors, remove the placement group, stop the local instance

The daemons share nothing but files, so the run directory must be on storage that
every node sees, at the same path (a shared filesystem), and so must the model
folder, task files and the working directory the daemons start in (this
command's). Every node needs the same asyncgrpo installation. Ray is an optional
extra: it is imported only here, when a RayLauncher is made.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.children import DIE_WITH_PARENT_ENV, spawn
from pipeline.errors import RunError

if TYPE_CHECKING:
    from pipeline.config import Config
    from pipeline.run import Role

log = logging.getLogger("asyncgrpo.ray")
INSTALL_HINT = "pip install -e '.[ray]'"
ACTOR_LOST = -1            # the exit code recorded when an actor (not its daemon) died
KILL_WAIT_S = 10.0
OBJECT_STORE_BYTES = 128 * 2**20   # the local instance's: only exit codes pass through Ray's object store


class DaemonActor:
    """Runs one daemon's command as a subprocess of this Ray actor (made a Ray actor by RayLauncher).

    The subprocess is killed (SIGKILL, not SIGTERM as under the local launcher) the moment
    this actor dies, and so are torchrun's ranks with torchrun (DIE_WITH_PARENT_ENV): the
    supervisor then starts the daemon anew in a new actor, and two trainers of one run must
    never overlap, not even while the old one checkpoints. (Every daemon survives a kill -9
    without loss; see README "Fault tolerance".) Async: every
    method runs on the actor's one event-loop thread, the thread that starts the
    subprocess, so PR_SET_PDEATHSIG (sent when the parent *thread* ends) fires only when
    the actor itself dies."""

    def __init__(self, name: str, log_path: str, cwd: str):
        self.name, self.log_path, self.cwd = name, Path(log_path), cwd
        self.proc = None
        self.stopping = False

    def __repr__(self) -> str:   # how Ray names this actor in its logs and dashboard
        return f"asyncgrpo-{self.name}"

    async def run(self, argv: list[str]) -> int:
        """Start `argv` and return its exit code (negative: the signal that ended it). argv[0], the
        launching machine's interpreter, becomes this node's (the same installation, perhaps elsewhere);
        the daemon starts in the launching command's directory where this node has it."""
        if self.stopping:   # a stop that arrived before this call: never start
            return 0
        cwd = self.cwd if os.path.isdir(self.cwd) else None
        self.proc = spawn([sys.executable, *argv[1:]], self.log_path, own_group=True, cwd=cwd,
                          death_signal=signal.SIGKILL, env={DIE_WITH_PARENT_ENV: "1"})
        while (code := self.proc.poll()) is None:
            await asyncio.sleep(0.2)
        return code

    async def send(self, signum: int) -> None:
        """SIGTERM to the daemon; SIGKILL to its whole process group (torchrun's ranks, vLLM's engine)."""
        self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        if signum == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(signum)


@dataclass
class RayDaemon:
    """The supervisor's handle of one daemon run by a DaemonActor (pipeline.run.Daemon)."""

    name: str
    argv: list[str]
    log_path: Path
    ray: Any                  # the ray module (imported by RayLauncher: Ray is optional)
    actor_cls: Any
    options: dict             # the actor's resources and placement
    cwd: str
    actor: Any = None
    done: Any = None          # ObjectRef of the actor's run(): the exit code
    code: int | None = None
    restarts: int = 0
    next_start: float = 0.0
    exits: list[int] = field(default_factory=list)

    def start(self) -> None:
        if self.actor is None:
            self.actor = self.actor_cls.options(**self.options).remote(self.name, str(self.log_path), self.cwd)
        self.code = None
        self.done = self.actor.run.remote(self.argv)

    def poll(self) -> int | None:
        ray = self.ray
        if self.done is None or self.code is not None:
            return self.code
        ready, _ = ray.wait([self.done], timeout=0)
        if ready:
            self.code = self._exit_code()
        return self.code

    def _exit_code(self) -> int:
        try:
            return self.ray.get(self.done)
        except self.ray.exceptions.RayError as e:   # its worker or node died, or it could not start
            log.warning("%s's Ray actor died, recorded as exit code %d; see %s", self.name, ACTOR_LOST, self.log_path)
            _note(self.log_path, f"asyncgrpo run: the Ray actor running {self.name} ended (a restart makes "
                                 f"a new one). Ray says: {e}")
            self.actor = None
            return ACTOR_LOST

    def terminate(self) -> None:
        if self.actor is not None and self.poll() is None:
            self.actor.send.remote(signal.SIGTERM)

    def kill(self) -> None:
        if self.actor is None or self.poll() is not None:
            return
        self.actor.send.remote(signal.SIGKILL)
        if not self.wait(KILL_WAIT_S):   # the actor itself does not answer
            self.ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None) -> bool:
        if self.done is None or self.code is not None:
            return True
        ready, _ = self.ray.wait([self.done], timeout=timeout)
        if ready:
            self.poll()
        return bool(ready)


def _note(log_path: Path, line: str) -> None:
    """A line from the launcher in a daemon's log (best effort: the log is for people)."""
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


class RayLauncher:
    """The daemons as Ray actors with the resources of the [ray] section (pipeline.run.Launcher)."""

    name = "ray"

    def __init__(self, cfg: Config, *, address: str | None = None):
        try:
            import ray
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            raise RunError(f"--launcher ray needs Ray, an optional extra that is not installed here: "
                           f"{INSTALL_HINT} (or --launcher local)") from None
        self.ray = ray
        # Ray does not restart an actor: the supervisor does, with its backoff and limits. Concurrent calls:
        # send() must run while run() waits for the daemon.
        self.actor_cls = ray.remote(max_restarts=0, max_concurrency=4)(DaemonActor)
        self.cfg, self.address = cfg, address
        self.ray_cfg = cfg.ray
        self.trainer_ranks = cfg.ray.trainer_ranks
        self.max_trainer_restarts = cfg.ray.max_trainer_restarts
        self.resume_args = " --launcher ray" + (f" --address {address}" if address else "")
        self.started_ray = False
        self.placement = None
        self.daemons: list[RayDaemon] = []

    def open(self, echo) -> None:
        ray = self.ray
        common = dict(log_to_driver=False, logging_level=logging.WARNING)
        if self.address is None:
            cpus = len(os.sched_getaffinity(0))
            ray.init(address="local", num_cpus=cpus, include_dashboard=self.ray_cfg.include_dashboard,
                     object_store_memory=OBJECT_STORE_BYTES, **common)
            self.started_ray = True
        else:
            try:
                ray.init(address=self.address, **common)
            except ConnectionError as e:
                raise RunError(f"cannot connect to the Ray cluster at --address {self.address!r}: {e}; start it "
                               "with `ray start --head` (or leave --address out for a local Ray instance)") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
        where = "a local Ray instance" if self.started_ray else f"the Ray cluster at {self.address}"
        echo(f"Ray: {where}, {len(nodes)} node(s), {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs")
        problem = self._misfit(nodes, total)
        if problem and self.started_ray:
            raise RunError(problem)
        if problem:
            log.warning("%s; the daemons wait until the cluster has room", problem)

    def _misfit(self, nodes: list[dict], total: dict) -> str | None:
        """Why the [ray] section's requests can never be placed on this cluster (None: they fit in sum,
        and the trainer fits on one node)."""
        r, n = self.ray_cfg, self.cfg.run.num_generators
        helper = self.cfg.compactor.every_s is not None
        for unit, per_rank, per_gen, per_helper in (("CPU", r.trainer_cpus, r.generator_cpus, r.compactor_cpus),
                                                      ("GPU", r.trainer_gpus, r.generator_gpus, 0.0)):
            kind = unit.lower()
            need = per_rank * r.trainer_ranks + per_gen * n + (per_helper if helper else 0.0)
            have = total.get(unit, 0.0)
            if need > have + 1e-9:
                parts = [f"ray.trainer_{kind}s = {per_rank:g} x {r.trainer_ranks} rank(s)",
                         f"ray.generator_{kind}s = {per_gen:g} x {n} generator(s)"]
                if unit == "CPU" and helper:
                    parts.append(f"ray.compactor_cpus = {per_helper:g}")
                return (f"the run asks Ray for {need:g} {unit}s ({' + '.join(parts)}) but {self._cluster()} has "
                        f"{have:g}: lower these settings (--set ray.generator_{kind}s=...), run fewer generators, "
                        "or use a bigger cluster (--address)")
            trainer = per_rank * r.trainer_ranks
            largest = max((nd.get("Resources", {}).get(unit, 0.0) for nd in nodes), default=0.0)
            if trainer > largest + 1e-9:
                return (f"ray.trainer_{kind}s = {per_rank:g} x {r.trainer_ranks} rank(s) asks for {trainer:g} "
                        f"{unit}s on one node, but the largest node of {self._cluster()} has {largest:g}")
        return None

    def _cluster(self) -> str:
        return "the local Ray instance" if self.started_ray else f"the Ray cluster at {self.address}"

    def daemon(self, role: Role, index: int, name: str, argv: list[str], log_path: Path) -> RayDaemon:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = self.ray_cfg
        if role == "trainer":
            cpus, gpus = r.trainer_cpus * r.trainer_ranks, r.trainer_gpus * r.trainer_ranks
            bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
            self.placement = placement_group([bundle], strategy="STRICT_PACK")
            placement = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=0)
            options = dict(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=placement)
        elif role == "generator":
            options = dict(num_cpus=r.generator_cpus, num_gpus=r.generator_gpus)
        else:
            options = dict(num_cpus=r.compactor_cpus)
        d = RayDaemon(name, argv, log_path, self.ray, self.actor_cls, options, cwd=os.getcwd())
        self.daemons.append(d)
        return d

    def close(self) -> None:
        """Kill the actors (their daemons have stopped, or die with them), remove the placement group,
        and stop the Ray instance this launcher started."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        if not ray.is_initialized():
            return
        for d in self.daemons:
            if d.actor is not None:
                ray.kill(d.actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
        ray.shutdown()
        if self.started_ray:
            _wait_for_ray_processes_to_end()


def _wait_for_ray_processes_to_end(timeout_s: float = 10.0) -> None:
    """ray.shutdown() signals the local instance's processes; wait until they have gone (best effort)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and _ray_children():
        time.sleep(0.1)


def _ray_children() -> list[int]:
    """Live child processes of this one (Ray's local instance: gcs_server, raylet, ...)."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(d.name))
    return out
