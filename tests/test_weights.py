"""WeightStore: complete folders only, LATEST atomic, pruning and abandoning, loads like the source."""

import json
import subprocess
import sys
import time

import pytest
import torch

from helpers.trainer_fixtures import REPO, env, model_folder  # noqa: F401 - fixture
from workers.weights import WeightStore


@pytest.fixture(scope="module")
def model_and_tok(model_folder):  # noqa: F811
    from workers.model import load_model, load_tokenizer

    return load_model(model_folder), load_tokenizer(model_folder)


def test_publish_loads_like_the_source(tmp_path, model_folder, model_and_tok):  # noqa: F811
    from workers.model import load_model, load_tokenizer

    model, tok = model_and_tok
    store = WeightStore(tmp_path / "weights", source=model_folder)
    assert store.latest() is None
    folder = store.publish(model, tok, 0)
    assert folder == tmp_path / "weights" / "v00000000" and store.latest() == 0
    # Tokenizer files are the source's, byte for byte, so the folder loads exactly like it.
    for name in ("tokenizer.json", "tokenizer_config.json", "asyncgrpo.json"):
        assert (folder / name).read_bytes() == (model_folder / name).read_bytes()
    assert json.loads((folder / "weights.json").read_text())["version"] == 0
    again = load_model(folder)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert load_tokenizer(folder)("12+34=").input_ids == tok("12+34=").input_ids
    assert list((tmp_path / "weights" / "tmp").iterdir()) == []
    with pytest.raises(FileExistsError, match="never change"):
        store.publish(model, tok, 0)


def test_prune_keeps_newest_and_latest(tmp_path, model_and_tok):
    model, tok = model_and_tok
    store = WeightStore(tmp_path / "w")
    for v in range(5):
        store.publish(model, tok, v)
    assert store.prune(2) == [0, 1, 2]
    assert store.versions() == [3, 4] and store.latest() == 4
    store.set_latest(3)  # a reader's version is never pruned while LATEST names it
    store.publish(model, tok, 5)
    store.set_latest(3)
    assert store.prune(1) == [4]
    assert store.versions() == [3, 5]


def test_abandon_after_moves_newer_versions_and_resets_latest(tmp_path, model_and_tok):
    model, tok = model_and_tok
    store = WeightStore(tmp_path / "w")
    for v in (0, 2, 4, 6):
        store.publish(model, tok, v)
    assert store.abandon_after(3) == [4, 6]
    assert store.versions() == [0, 2] and store.latest() == 2
    assert len(list(store.abandoned.iterdir())) == 2
    store.publish(model, tok, 4)  # the version can be taken again on the new timeline
    assert store.latest() == 4


def test_reader_never_sees_a_partial_folder(tmp_path, model_and_tok, model_folder):  # noqa: F811
    """A reader polling LATEST while 40 versions are published and pruned sees only whole folders."""
    model, tok = model_and_tok
    store = WeightStore(tmp_path / "weights", source=model_folder)
    store.publish(model, tok, 0)
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "trainer_weights_reader.py"),
                               str(store.root), str(stop), "240"], env=env(), stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    publish_s = 0.0
    with torch.no_grad():
        for v in range(1, 41):
            model.model.norm.weight.add_(0.01)  # each version differs
            t0 = time.time()
            store.publish(model, tok, v)
            store.prune(2)
            publish_s += (time.time() - t0) / 40
            if v % 4 == 0:                      # paced on the reader: it reads every 4th version whole
                _wait_until_seen(reader, v)
    stop.touch()
    result = json.loads(reader.stdout.read().splitlines()[-1])
    reader.wait(timeout=30)
    assert result["bad"] == 0, result["messages"]
    assert result["versions_seen"] >= 10, result   # it really read during the publications (the pacing's 4, 8, ...)
    assert store.versions() == [39, 40] and store.latest() == 40
    assert list(store.tmp.iterdir()) == []
    assert publish_s < 1.0


def _wait_until_seen(reader: subprocess.Popen, version: int) -> None:
    """Read the reader's "seen V" lines until it has read `version` (LATEST names it until the next publication)."""
    while True:
        line = reader.stdout.readline()
        assert line.startswith("seen "), f"the reader stopped before it read v{version}: {line!r}"
        if int(line.split()[1]) >= version:
            return
