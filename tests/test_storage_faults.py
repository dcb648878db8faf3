"""Storage faults: full disk, read-only run, damaged weights and checkpoints, missing files.

Each gives one clear error naming the file (exit code 2 through the CLI) or sets the damaged
thing aside with a reason; what was published before stays readable. A full disk is simulated
with RLIMIT_FSIZE in a subprocess (SIGXFSZ ignored, so a write past the limit raises EFBIG);
a read-only run with a read-only bind mount (root) or by removing write permission.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest

from buffer import BufferSQL, ShardWriter
from conftest import REPO, make_group, run_cli
from helpers.trainer_fixtures import model_folder  # noqa: F401

LIMITED_PRELUDE = """
import json, resource, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from conftest import make_group
def limit(n):   # every file this process writes from here on must stay under n bytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def run_limited(code: str, timeout: float = 120) -> dict:
    """Run `code` in a subprocess that ignores SIGXFSZ; its last stdout line is a JSON object."""
    script = LIMITED_PRELUDE.format(repo=str(REPO), tests=str(REPO / "tests")) + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                       preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fill(buf: Path, n: int) -> list[str]:
    with ShardWriter(buf, flush_groups=2, flush_seconds=None) as w:
        return [w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"p{i}", seed=i)) for i in range(n)]


# ---- full disk --------------------------------------------------------------------------------

def test_full_disk_shard_flush_names_the_shard_and_keeps_flushed_ones(buf):
    out = run_limited(f"""
        from buffer import ShardWriter, StorageError
        w = ShardWriter({str(buf)!r}, flush_groups=2, flush_seconds=None)
        for i in range(2):
            w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"p{{i}}", seed=i, tokens=64))
        w.wait()                # the first shard is on disk before the limit
        limit(2000)
        for i in range(2, 4):   # the second append hands the shard to a flush thread
            w.append(make_group(0, [1, 0, 0, 1], prompt_id=f"p{{i}}", seed=i, tokens=64))
        try:
            w.flush()           # waits for it: its error comes out here
        except StorageError as e:
            print(json.dumps({{"error": str(e), "errno": e.errno, "pending": w.pending_groups}}))
    """)
    assert out["errno"] == 27 and out["pending"] == 2     # EFBIG; the groups are back in memory for a retry
    assert out["error"].startswith(f"cannot write {buf}/shards/w000000-000001.parquet: File too large [EFBIG]; "
                                   "free disk space")
    assert os.listdir(buf / "tmp") == []                  # no temp file left behind
    assert [p.name for p in (buf / "shards").iterdir()] == ["w000000-000000.parquet"]
    assert BufferSQL(buf).query("SELECT count(DISTINCT group_id) n FROM rollouts").to_pylist() == [{"n": 2}]


def test_full_disk_ledger_write_records_nothing(buf):
    ids = _fill(buf, 4)
    out = run_limited(f"""
        from buffer import Sampler, StorageError
        with Sampler({str(buf)!r}) as s:
            limit(100)
            try:
                s.pull(2, trainer_version=0, trainer_step=1, max_staleness=None)
            except StorageError as e:
                print(json.dumps({{"error": str(e)}}))
    """)
    assert out["error"].startswith(f"cannot write {buf}/ledger/step-000000001-0000.parquet: File too large")
    assert sorted(p.name for p in (buf / "ledger").glob("*.parquet")) == []
    from buffer import Sampler
    with Sampler(buf) as s:                              # the pull that failed took nothing
        assert s.pull(4, trainer_version=0, trainer_step=1, max_staleness=None).group_ids == ids


def test_full_disk_publish_leaves_latest_on_the_complete_version(tmp_path, model_folder):  # noqa: F811
    from workers.model import load_model, load_tokenizer
    from workers.weights import WeightStore

    root = tmp_path / "weights"
    store = WeightStore(root, source=model_folder)
    store.publish(load_model(model_folder), load_tokenizer(model_folder), 0)
    out = run_limited(f"""
        from buffer import StorageError
        from workers.model import load_model, load_tokenizer
        from workers.weights import WeightStore
        m = {str(model_folder)!r}
        store = WeightStore({str(root)!r}, source=m)
        model, tok = load_model(m), load_tokenizer(m)
        limit(100_000)
        try:
            store.publish(model, tok, 1)
        except StorageError as e:
            print(json.dumps({{"error": str(e), "errno": e.errno}}))
    """)
    assert out["errno"] == 27 and out["error"].startswith(f"cannot write {root}/v00000001: File too large")
    assert store.latest() == 0 and store.versions() == [0] and store.is_complete(0)
    assert os.listdir(root / "tmp") == []


@pytest.mark.slow
def test_trainer_on_a_full_disk_exits_2_naming_the_folder(tmp_path, model_folder):  # noqa: F811
    run = _run_dir(tmp_path, model_folder)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    r = subprocess.run([sys.executable, "-m", "pipeline", "train", "--run", str(run)], capture_output=True,
                       text=True, timeout=180, env=env, cwd=REPO, preexec_fn=limited)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"asyncgrpo: error: cannot write {run}/weights/v00000000: File too large [EFBIG]" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (run / "weights" / "v00000000").exists() and os.listdir(run / "weights" / "tmp") == []


# ---- read-only run ----------------------------------------------------------------------------

@contextmanager
def read_only(path: Path):
    """`path` made read-only: a read-only bind mount as root, else write permission removed."""
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot bind-mount read-only here: {r.stderr.decode().strip()}")
        try:
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p, m in modes.items():
            p.chmod(m & ~0o222)
        try:
            yield
        finally:
            for p, m in modes.items():
                p.chmod(m)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_read_only_run_can_be_queried_and_nothing_changes(tmp_path):
    run = tmp_path / "run"
    _fill(run / "buffer", 6)
    bad = run / "buffer" / "shards" / "w000000-000001.parquet"
    bad.write_bytes(bad.read_bytes()[:100])                  # damaged, and it cannot be moved aside
    before = _snapshot(run)
    with read_only(run):
        q = run_cli("sql", str(run), "--format", "json", "SELECT count(DISTINCT group_id) n FROM rollouts")
        s = run_cli("status", str(run), "--json")
        c = run_cli("compact", str(run), "--min-age", "0")
    assert q.returncode == 0 and json.loads(q.stdout) == [{"n": 4}], q.stderr
    assert f"asyncgrpo: warning: left out unreadable file {bad}" in q.stderr and "Traceback" not in q.stderr
    assert s.returncode == 0 and json.loads(s.stdout)["groups"] == 4, s.stderr
    assert c.returncode == 2 and "Traceback" not in c.stderr
    assert c.stderr.startswith(f"asyncgrpo: error: cannot write {run}/buffer/buffer.lock: ") and "[E" in c.stderr
    assert _snapshot(run) == before


@pytest.mark.slow
def test_trainer_on_a_read_only_run_exits_2_naming_a_file(tmp_path, model_folder):  # noqa: F811
    run = _run_dir(tmp_path, model_folder)
    before = _snapshot(run)
    with read_only(run):
        r = run_cli("train", "--run", str(run), timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith(f"asyncgrpo: error: cannot write {run}/") and "Traceback" not in r.stderr
    assert _snapshot(run) == before


# ---- damaged weights, checkpoints, missing files -----------------------------------------------

def _run_dir(tmp_path: Path, model_folder: Path, *sets: str) -> Path:
    """A run directory as `asyncgrpo run` prepares it: config.toml and run.json naming the model."""
    from pipeline.config import load_config, save_config
    from pipeline.rundir import write_run_info

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ["run.eval_size=2", "trainer.num_threads=1", "trainer.groups_per_step=2",
                             "trainer.max_wait_seconds=0.5", *sets])
    save_config(cfg, run / "config.toml")
    write_run_info(run, {"initial_model": str(model_folder), "eval_before": 0.0})
    return run


def _publish(run: Path, model_folder: Path, *versions: int) -> None:
    from workers.model import load_model, load_tokenizer
    from workers.weights import WeightStore

    store = WeightStore(run / "weights", source=model_folder)
    model, tok = load_model(model_folder), load_tokenizer(model_folder)
    for v in versions:
        store.publish(model, tok, v)


def _latest_names_missing(run: Path) -> None:
    (run / "weights" / "LATEST").write_text("7\n")


def _version_without_weights(run: Path) -> None:
    (run / "weights" / "v00000001" / "model.safetensors").unlink()


def _no_run_json(run: Path) -> None:
    (run / "run.json").unlink()


def _model_folder_gone(run: Path) -> None:
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "initial_model": str(run / "gone")}))


@pytest.mark.parametrize("damage, args, message", [
    (_latest_names_missing, ["eval", "--run", "{run}"], "weights version 7 of '{run}' is not on disk"),
    (_version_without_weights, ["eval", "--run", "{run}", "--version", "1"],
     "model folder '{run}/weights/v00000001' has no weights (*.safetensors)"),
    (_no_run_json, ["train", "--run", "{run}"], "names no initial model (run.json missing)"),
    (_model_folder_gone, ["train", "--run", "{run}"], "model folder '{run}/gone' does not exist"),
])
def test_missing_files_are_one_clear_error(tmp_path, model_folder, damage, args, message):  # noqa: F811
    run = _run_dir(tmp_path, model_folder)
    _publish(run, model_folder, 0, 1)
    damage(run)
    r = run_cli(*[a.format(run=run) for a in args], timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr[-3000:])
    assert message.format(run=run) in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1                       # one paragraph


def test_resume_sets_damaged_weights_and_checkpoints_aside(tmp_path, model_folder):  # noqa: F811
    """Leftovers in weights/tmp, the resumed version's folder without weights, the newest checkpoint
    truncated: the trainer resumes from the checkpoint before, republishes, and keeps the evidence."""
    from helpers.trainer_fixtures import sampled, write_buffer
    from workers.trainer import TrainerConfig, run_trainer
    from workers.trainer.checkpoint import list_checkpoints
    from workers.weights import WeightStore

    groups = [g for g in sampled(str(model_folder), 24) if len({c.reward for c in g.completions}) > 1][:8]
    write_buffer(tmp_path, groups)
    cfg = dict(groups_per_step=2, checkpoint_every=1, keep_checkpoints=3, num_threads=1, metrics_flush_seconds=0.0,
               max_steps=3, publish_every=1)
    run_trainer(tmp_path, TrainerConfig(**cfg), model_folder=model_folder, offline=True)
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [s for s, _ in ckpts] == [1, 2, 3]
    newest = ckpts[-1][1]
    newest.write_bytes(newest.read_bytes()[:1000])              # damaged: resume must use step 2
    store = WeightStore(tmp_path / "weights")
    (store.folder(2) / "model.safetensors").unlink()             # the version resumed from, half gone
    (store.tmp / "host%1%abcd%v00000009").mkdir(parents=True)    # a crashed publisher's folder
    (store.tmp / "host%1%abcd%v00000009" / "config.json").write_text("{}")

    run_trainer(tmp_path, TrainerConfig(**{**cfg, "max_steps": 4}), model_folder=model_folder, offline=True,
                resume=True)
    damaged = tmp_path / "checkpoints" / "damaged"
    assert sorted(p.name for p in damaged.iterdir()) == [newest.name, f"{newest.name}.reason.json"]
    assert "RuntimeError" in json.loads((damaged / f"{newest.name}.reason.json").read_text())["reason"]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")][-1] == 4
    assert store.latest() == 4 and store.is_complete(2) and store.is_complete(4)
    aside = [p.name for p in store.abandoned.iterdir()]
    assert any(n.endswith("-damaged-v00000002") for n in aside)
    assert any(n.endswith("-damaged-v00000002.reason.json") for n in aside)
    assert os.listdir(store.tmp) == []
    steps = BufferSQL(tmp_path).query("SELECT trainer_step s, count(*) n FROM consumed GROUP BY 1 ORDER BY 1")
    assert steps.to_pylist() == [{"s": s, "n": 2} for s in (1, 2, 3, 4)]   # step 3 taken again, once


def test_no_readable_checkpoint_is_an_error_that_moves_nothing(tmp_path, model_folder):  # noqa: F811
    from workers.trainer import TrainerConfig, TrainerError, run_trainer

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "step-000000002.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainerError, match=r"no checkpoint of this run can be read: .*step-000000002\.pt"):
        run_trainer(tmp_path, TrainerConfig(num_threads=1), model_folder=model_folder, resume=True)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000000002.pt"]


def test_weights_tmp_leftovers_are_invisible_to_readers(tmp_path, model_folder):  # noqa: F811
    from workers.weights import WeightStore

    store = WeightStore(tmp_path / "weights", source=model_folder)
    _publish(tmp_path, model_folder, 0)
    (store.tmp / "host%1%abcd%v00000001").mkdir()
    assert store.latest() == 0 and store.versions() == [0] and store.is_complete(0)
    assert not store.is_complete(1)
