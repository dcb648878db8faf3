"""workers.remote_weights on a real S3 API server: the trainer uploads a version, a generator's cache
downloads and verifies it, and the model loaded from the cache gives the trainer's greedy output;
a killed upload is never visible, a damaged object is never loaded, the cache stays bounded."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from buffer.store import open_store
from workers.model import init_model, load_model, load_tokenizer
from workers.remote_weights import COMPLETE, RemoteWeights, WeightsError


@pytest.fixture
def run(s3env):
    bucket = s3env.create_bucket(f"w-{uuid.uuid4().hex[:8]}")
    return open_store(f"s3://{bucket}/run")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m") / "tiny"
    init_model(folder, seed=3)
    return folder


def _greedy(folder, prompt="12+7=") -> list[int]:
    tok, model = load_tokenizer(folder), load_model(folder)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    return out[0].tolist()


def _cached(cache) -> list[str]:
    """The versions in a generator's cache folder (v<version>-<digest>), by name without the digest."""
    return sorted(p.name.split("-")[0] for p in cache.iterdir() if p.name != "tmp") if cache.is_dir() else []


def _changed(model_folder, dest):
    """A copy of `model_folder` with other weights (every parameter + 1e-3): another publication."""
    model = load_model(model_folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    model.save_pretrained(dest, safe_serialization=True)
    load_tokenizer(model_folder).save_pretrained(dest)
    return dest


def test_upload_then_fetch_loads_the_same_model(run, model_folder, tmp_path):
    trainer = RemoteWeights(run)
    assert trainer.latest() is None
    trainer.upload(model_folder, 1)
    assert trainer.latest() == 1
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache")
    folder = gen.fetch(gen.latest())
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("v00000001-")
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in model_folder.iterdir())
    for p in model_folder.iterdir():
        assert (folder / p.name).read_bytes() == p.read_bytes()
    assert gen.verify_cached(1)
    assert _greedy(folder) == _greedy(model_folder)
    trainer.upload(model_folder, 1)            # the same files again (killed before LATEST): only LATEST moves
    assert trainer.latest() == 1
    other = tmp_path / "other"
    other.mkdir()
    for p in model_folder.iterdir():
        (other / p.name).write_bytes(p.read_bytes() + (b" " if p.name == "config.json" else b""))
    with pytest.raises(FileExistsError, match="already published with other files"):
        trainer.upload(other, 1)


def test_a_killed_upload_is_never_visible(run, model_folder, tmp_path):
    """An upload killed after its files but before COMPLETE.json: not LATEST, and fetch refuses it."""
    trainer = RemoteWeights(run)
    trainer.upload(model_folder, 1)
    for p in model_folder.iterdir():                       # version 2's files, then the kill
        run.upload(f"weights/v00000002/{p.name}", p)
    assert trainer.latest() == 1
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache")
    with pytest.raises(WeightsError, match=r"v00000002 is not published \(no COMPLETE\.json"):
        gen.fetch(2)
    assert _cached(tmp_path / "cache") == []
    trainer.upload(model_folder, 2)                        # the restarted trainer publishes it again
    assert trainer.latest() == 2 and gen.fetch(2).is_dir()


def test_a_damaged_object_is_never_loaded(run, model_folder, tmp_path):
    trainer = RemoteWeights(run)
    trainer.upload(model_folder, 1)
    listing = json.loads(run.read(f"weights/v00000001/{COMPLETE}"))
    name = next(n for n in listing if n.endswith(".safetensors"))
    data = bytearray(run.read(f"weights/v00000001/{name}"))
    data[-1] ^= 0xFF                                         # same size, one bit flipped
    run.publish(f"weights/v00000001/{name}", bytes(data))
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache")
    with pytest.raises(WeightsError, match=rf"{name}: \d+ bytes that do not match COMPLETE\.json"):
        gen.fetch(1)
    assert _cached(tmp_path / "cache") == []
    assert os.listdir(tmp_path / "cache" / "tmp") == []     # the partial download is gone


def test_the_cache_keeps_the_newest_versions(run, model_folder, tmp_path):
    trainer = RemoteWeights(run)
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache", keep=2)
    for v in range(1, 5):
        trainer.upload(model_folder, v)
        gen.fetch(v)
    assert _cached(tmp_path / "cache") == ["v00000003", "v00000004"]
    gen.fetch(1)                                             # an old version asked for again: kept while in use
    assert _cached(tmp_path / "cache") == ["v00000001", "v00000004"]


def test_a_killed_download_is_cleaned_and_never_loaded(run, model_folder, tmp_path):
    """What a generator killed mid-download leaves (cache/tmp/<its pid>-...) is removed by the next
    one, which downloads the version whole."""
    import subprocess
    import sys

    RemoteWeights(run).upload(model_folder, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / "cache" / "tmp" / f"{dead.stdout.strip()}-abcd1234-v00000001"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert gen.fetch(1).is_dir() and gen.verify_cached(1)


def test_a_version_published_again_after_a_resume_is_downloaded_again(run, model_folder, tmp_path):
    """A resume withdraws v2 and publishes other weights as v2: a generator that cached the first v2 gets
    the second, not its stale copy (the cache folder is named after COMPLETE.json's digest)."""
    trainer = RemoteWeights(run)
    trainer.upload(model_folder, 1)
    trainer.upload(model_folder, 2)
    gen = RemoteWeights(open_store(run.uri), cache=tmp_path / "cache")
    first = gen.fetch(2)
    assert trainer.abandon_after(1) == [2] and trainer.latest() == 1 and not trainer.is_complete(2)
    other = _changed(model_folder, tmp_path / "other")
    trainer.upload(other, 2)
    second = gen.fetch(2)
    assert second != first and gen.verify_cached(2)
    for p in other.iterdir():
        assert (second / p.name).read_bytes() == p.read_bytes()
    assert _greedy(second) == _greedy(other)


def test_a_resume_withdraws_versions_that_latest_never_listed(run, model_folder, tmp_path):
    """A trainer killed after v3's COMPLETE.json but before its LATEST state, and one killed mid-upload of
    v4: the resume from v2 withdraws both, so it can publish other weights as v3 and v4."""
    trainer = RemoteWeights(run)
    for v in (1, 2):
        trainer.upload(model_folder, v)
    killed = RemoteWeights(open_store(run.uri))

    def kill(*args, **kwargs):
        raise KeyboardInterrupt("killed before LATEST")
    killed._latest.update = kill
    with pytest.raises(KeyboardInterrupt):
        killed.upload(model_folder, 3)
    for p in model_folder.iterdir():                       # v4's files, no COMPLETE.json
        run.upload(f"weights/v00000004/{p.name}", p)
    assert trainer.versions() == [1, 2] and trainer.is_complete(3) and trainer.latest() == 2
    assert trainer.abandon_after(2) == [3, 4]
    assert run.list_folders("weights") == ["latest"] + [f"v0000000{v}" for v in (1, 2)]
    other = _changed(model_folder, tmp_path / "other")
    for v in (3, 4):
        trainer.upload(other, v)
    assert trainer.versions() == [1, 2, 3, 4] and trainer.latest() == 4


def test_checkpoints_mirrored_to_the_store_resume_elsewhere(run, tmp_path):
    """A trainer's checkpoints on the store: the newest `keep` complete ones are listed, one whose upload
    was killed (no COMPLETE.json) is not, and a resume on an empty machine downloads the newest whole."""
    from buffer.store import RemotePath
    from workers.trainer.checkpoint import RemoteCheckpoints, list_checkpoints

    here = tmp_path / "here"
    here.mkdir()
    mirror = RemoteCheckpoints(RemotePath(run, ""), keep=2)
    for step in (4, 8, 12):
        f = here / f"step-{step:09d}.pt"
        f.write_bytes(bytes([step]) * 1000)
        mirror.upload(f)
    dcp = here / "step-000000016.dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"meta")
    (dcp / "state.pt").write_bytes(b"state" * 100)
    mirror.upload(dcp)
    mirror.wait()
    assert mirror.steps() == [(12, "step-000000012.pt"), (16, "step-000000016.dcp")]
    run.upload("checkpoints/step-000000020.pt/step-000000020.pt", here / "step-000000012.pt")   # killed: no COMPLETE
    assert [s for s, _ in mirror.steps()] == [12, 16]
    elsewhere = tmp_path / "elsewhere"
    got = mirror.fetch_newer(elsewhere)
    assert got == elsewhere / "step-000000016.dcp" and [s for s, _ in list_checkpoints(elsewhere)] == [16]
    assert sorted(p.name for p in got.iterdir()) == [".metadata", "state.pt"]
    assert (got / "state.pt").read_bytes() == b"state" * 100
    assert mirror.fetch_newer(elsewhere) is None and list(elsewhere.joinpath("tmp").iterdir()) == []
    assert mirror.remove_after(12) == ["step-000000016.dcp", "step-000000020.pt"]
    assert mirror.steps() == [(12, "step-000000012.pt")]
    assert mirror.fetch_newer(tmp_path / "third") == tmp_path / "third" / "step-000000012.pt"
    assert (tmp_path / "third" / "step-000000012.pt").read_bytes() == bytes([12]) * 1000


def test_a_trainer_on_another_machine_restores_its_version_from_the_store(run, model_folder, tmp_path):
    """The version a resume starts at is downloaded into the new machine's weights folder, not published
    again (its weights.json would differ), and LATEST stays complete."""
    from workers.remote_weights import MirroredWeightStore

    first = MirroredWeightStore(tmp_path / "a", RemoteWeights(run), source=model_folder)
    model, tok = load_model(model_folder), load_tokenizer(model_folder)
    first.publish(model, tok, 3, info={"step": 3})
    second = MirroredWeightStore(tmp_path / "b", RemoteWeights(open_store(run.uri)), source=model_folder)
    assert not second.restore(4) and second.restore(3) and not second.restore(3)
    assert sorted(p.name for p in second.folder(3).iterdir()) == sorted(p.name for p in first.folder(3).iterdir())
    for p in first.folder(3).iterdir():
        assert (second.folder(3) / p.name).read_bytes() == p.read_bytes()
    second.sync(3)
    assert second.remote.latest() == 3 and second.is_complete(3)


def test_a_resume_takes_the_stores_checkpoint_when_the_local_copy_is_damaged(run, tmp_path):
    """The newest local checkpoint is damaged and the store holds it whole: the resume sets the local copy
    aside and downloads the store's (rather than going back to an older local one and withdrawing the good
    copy); a folder an upload left without COMPLETE.json is withdrawn once a newer checkpoint is complete."""
    from buffer.store import RemotePath
    from workers.trainer import config_from_dict
    from workers.trainer.checkpoint import RemoteCheckpoints, list_checkpoints, save_checkpoint
    from workers.trainer.session import _newest_readable_checkpoint, _prefer_the_store

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    here = tmp_path / "here"
    mirror = RemoteCheckpoints(RemotePath(run, ""), keep=3)
    half = tmp_path / "half"
    half.write_bytes(b"half an upload")
    run.upload("checkpoints/step-000000007.pt/step-000000007.pt", half)     # killed before COMPLETE.json
    for step in (5, 10):
        with torch.no_grad():
            model.weight.fill_(step)
        mirror.upload(save_checkpoint(here, step=step, version=step, model=model, optimizer=opt, kl_state={},
                                      config=config_from_dict({}), keep=3))
    assert mirror.wait() and [s for s, _ in mirror.steps()] == [5, 10]
    assert "step-000000007.pt" not in run.list_folders("checkpoints")
    (here / "step-000000010.pt").write_bytes(b"damaged on disk")
    state = _newest_readable_checkpoint(here, list_checkpoints(here))
    assert state["step"] == 5 and (here / "damaged" / "step-000000010.pt").exists()
    state = _prefer_the_store(mirror, here, state)
    assert state["step"] == 10 and state["path"] == here / "step-000000010.pt"
    assert torch.equal(state["model"]["weight"], torch.full((2, 3), 10.0))
    assert [s for s, _ in mirror.steps()] == [5, 10]
