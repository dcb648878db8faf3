"""Child `asyncgrpo` processes that never outlive their parent.

Both supervisors (`asyncgrpo run` for its trainer and generators, `asyncgrpo
ablate` for its cells) and the Ray launcher's actors start children here: the
child asks the kernel for SIGTERM (a Ray actor's: SIGKILL) when its parent dies
(PR_SET_PDEATHSIG), so nothing is left behind even after a kill -9 of the
supervisor; output goes to a log file; optionally the child gets a process
group of its own (Ctrl-C reaches only the supervisor, which stops children in
order) and a set of cores.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# Set (to "1") in the environment of a Ray actor's daemon, and so inherited by torchrun's ranks.
DIE_WITH_PARENT_ENV = "ASYNCGRPO_DIE_WITH_PARENT"


def cli_argv(*args: str) -> list[str]:
    """The asyncgrpo command as this interpreter runs it (works without the console script)."""
    return [sys.executable, "-m", "pipeline", *args]


def trainer_argv(run_dir: str, *, resume: bool, ranks: int = 1) -> list[str]:
    """The trainer's command: `asyncgrpo train`, under torchrun (one node, `ranks` processes) when ranks > 1."""
    tail = ["--resume"] if resume else []
    if ranks == 1:
        return cli_argv("train", "--run", run_dir, *tail)
    # --run-dir: torchrun's parser takes "--run" for a prefix of its own --run-path.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", "pipeline", "train", "--run-dir", run_dir, *tail]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc, loaded once in the parent: a dlopen in a child forked from a threaded process (a Ray
    actor) can deadlock on a lock another thread held at the fork."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child before exec: `signum` when the parent exits (Linux; elsewhere a no-op)."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signum)


def die_with_parent_if_asked() -> None:
    """At the start of `python -m pipeline`: SIGKILL when the parent dies, if DIE_WITH_PARENT_ENV is set.

    For the trainer ranks that torchrun starts inside a Ray actor: torchrun gives each rank a
    session of its own, out of reach of a signal to torchrun's process group, so a rank would
    go on training after its actor and torchrun died, beside the trainer that replaces it."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1":
        return
    die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:   # the parent died before the line above
        os._exit(1)


def spawn(argv: list[str], log_path: Path, *, own_group: bool = False, cores: list[int] | None = None,
          cwd: str | None = None, death_signal: int = signal.SIGTERM,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` with stdout and stderr appended to `log_path`, tied to this process's life
    (it gets `death_signal` when this process dies); `env`: variables added to this process's."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _libc()   # loaded here, not in the child

    def pre() -> None:
        die_with_parent(death_signal)
        # Ray's processes block SIGINT, and a blocked mask is inherited: the daemon stops on it as it does locally.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if own_group:
            os.setpgid(0, 0)
        if cores:
            os.sched_setaffinity(0, cores)

    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pre, cwd=cwd,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log ('' if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
