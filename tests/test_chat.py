"""Chat prompts (`task.chat_template = true`): the prompt token ids equal
`tokenizer.apply_chat_template(...)` in the generator, the evaluator, the warm start and the
trainer's batch; the tiny tokenizer's template; the cache key; and the errors a user can hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffer import BufferSQL, Sampler
from conftest import REPO, run_cli
from pipeline.config import load_config, save_config
from pipeline.rundir import write_run_info
from workers.chat import ChatFormat, chat_messages, encode_prompts
from workers.model import BOS, CHARACTERS, SPECIAL_TOKENS, ModelError
from workers.tasks import TaskConfig, load_task
from workers.warmstart import WarmstartConfig, cache_key

torch.set_num_threads(1)

SYSTEM = "answer,briefly"
SPREAD = ('reward.functions=[{name = "tests.helpers.custom_rewards:text_checksum"}, '
          '{name = "accuracy", weight = 0.0}]')   # rewards spread within a group at any accuracy
PROMPTS = ["12+34=", "5*6=", "123+4567=", "7-"]  # different lengths: left padding is exercised
FORMATS = [ChatFormat(), ChatFormat(SYSTEM)]
FORMAT_IDS = ["no-system-prompt", "system-prompt"]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from workers.model import init_model
    return init_model(tmp_path_factory.mktemp("chat") / "tiny", seed=0)


@pytest.fixture(scope="module")
def no_template(tmp_path_factory, tiny) -> Path:
    """The tiny model with its chat template removed: what a base model's folder looks like."""
    import shutil
    folder = tmp_path_factory.mktemp("chat") / "no-template"
    shutil.copytree(tiny, folder)
    (folder / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    return folder


def reference_ids(folder: Path, text: str, chat: ChatFormat) -> list[int]:
    """What a user of transformers gets: AutoTokenizer.from_pretrained(folder).apply_chat_template(...)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    messages = ([{"role": "system", "content": chat.system_prompt}] if chat.system_prompt else []) + \
        [{"role": "user", "content": text}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def char_ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


# -- the tiny tokenizer's template ----------------------------------------------------------------

def test_tiny_template_renders_one_bos_and_known_characters(tiny):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny))
    messages = chat_messages("12+34=", ChatFormat(SYSTEM))
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        "<bos>s:answer,briefly/u:12+34=/a:"
    # one <bos>, no <unk>: every other character is a vocabulary entry of its own
    assert reference_ids(tiny, "12+34=", ChatFormat(SYSTEM)) == \
        [VOCAB[BOS]] + char_ids("s:answer,briefly/u:12+34=/a:")
    assert reference_ids(tiny, "7-", ChatFormat()) == [VOCAB[BOS]] + char_ids("u:7-/a:")
    # an assistant turn ends with <eos> (the SFT target's end)
    assert tok.apply_chat_template(messages + [{"role": "assistant", "content": "46"}], tokenize=False) == \
        "<bos>s:answer,briefly/u:12+34=/a:46<eos>"


@pytest.mark.parametrize("chat", FORMATS, ids=FORMAT_IDS)
def test_encode_prompts_is_apply_chat_template(tiny, chat):
    from workers.model import load_tokenizer
    tok = load_tokenizer(tiny)
    assert encode_prompts(tok, PROMPTS, chat) == [reference_ids(tiny, p, chat) for p in PROMPTS]
    # plain prompts are unchanged: <bos> then the characters
    assert encode_prompts(tok, PROMPTS) == [[VOCAB[BOS]] + char_ids(p) for p in PROMPTS]


def test_cache_key_unchanged_without_chat_and_distinct_with_it():
    ws = WarmstartConfig()
    # the key of the default config, as computed before chat prompts existed: runs/.cache stays valid
    assert cache_key(TaskConfig(), ws) == "25831fcc707fd8ef"
    keys = {cache_key(TaskConfig(), ws), cache_key(TaskConfig(chat_template=True), ws),
            cache_key(TaskConfig(chat_template=True, system_prompt=SYSTEM), ws),
            cache_key(TaskConfig(chat_template=True, system_prompt="other"), ws)}
    assert len(keys) == 4


# -- generation, evaluation, warm start, trainer ----------------------------------------------------

@pytest.mark.parametrize("chat", FORMATS, ids=FORMAT_IDS)
def test_hf_backend_samples_after_the_chat_template(tiny, chat):
    from workers.backends import SamplingConfig, make_backend
    from workers.grpo import token_logprobs
    from workers.model import load_model

    backend = make_backend("hf", tiny, seed=0, chat=chat)
    try:
        ids = backend.prompt_token_ids(PROMPTS)
        assert ids == [reference_ids(tiny, p, chat) for p in PROMPTS]
        groups = backend.generate(PROMPTS, n=3, sampling=SamplingConfig(max_new_tokens=6), seed=1)
    finally:
        backend.close()
    # the behaviour log-probs are those of the completions given the templated prompt, so that is
    # what the model was fed (a plain prompt gives other log-probs: checked below)
    model = load_model(tiny)
    worst, plain_gap = 0.0, 0.0
    for p, prompt_ids, group in zip(PROMPTS, ids, groups):
        for r in group:
            for pids, fed in ((prompt_ids, True), ([VOCAB[BOS]] + char_ids(p), False)):
                full = torch.tensor([pids + r.token_ids])                               # (1, P+C)
                with torch.no_grad():
                    logits = model(full).logits[0, len(pids) - 1:-1]                    # (C, V)
                gap = (torch.tensor(r.logprobs) - token_logprobs(logits, full[0, len(pids):], 1.0)).abs().max()
                if fed:
                    worst = max(worst, gap.item())
                else:
                    plain_gap = max(plain_gap, gap.item())
    assert worst < 1e-5 and plain_gap > 1e-2, (worst, plain_gap)


@pytest.mark.parametrize("chat", FORMATS, ids=FORMAT_IDS)
def test_evaluator_feeds_apply_chat_template_ids(tiny, chat, monkeypatch):
    from workers.evaluate import complete, evaluate
    from workers.model import load_model, load_tokenizer
    from workers.rewards import Scorer

    model, tok = load_model(tiny), load_tokenizer(tiny)
    fed: list[list[int]] = []
    real_generate = model.generate

    def spy(**kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]                       # (B, P) left padded
        assert bool((mask.cumsum(-1) > 0).eq(mask.bool()).all())                       # padding on the left only
        fed.extend(row[m.bool()].tolist() for row, m in zip(ids, mask))
        return real_generate(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    batched = complete(model, tok, PROMPTS, max_new_tokens=4, batch_size=3, chat=chat)
    assert fed == [reference_ids(tiny, p, chat) for p in PROMPTS]
    fed.clear()
    one_by_one = complete(model, tok, PROMPTS, max_new_tokens=4, batch_size=1, chat=chat)
    assert fed == [reference_ids(tiny, p, chat) for p in PROMPTS] and one_by_one == batched
    fed.clear()
    task = load_task(TaskConfig(num_train=10, num_eval=5, chat_template=True, system_prompt=chat.system_prompt))
    assert task.chat == chat
    result = evaluate(model, tok, task.eval, Scorer(), max_new_tokens=4, chat=task.chat)
    assert fed == [reference_ids(tiny, p.text, chat) for p in task.eval] and result.n == 5


@pytest.mark.parametrize("chat", FORMATS, ids=FORMAT_IDS)
def test_warm_start_trains_on_apply_chat_template_ids(tiny, chat):
    from workers.model import load_tokenizer
    from workers.warmstart import sft_tensors

    tok = load_tokenizer(tiny)
    prompts = load_task(TaskConfig(num_train=6, num_eval=2)).train
    inputs, targets, mask = sft_tensors(tok, prompts, chat)                              # (N, T) each
    for i, p in enumerate(prompts):
        want = reference_ids(tiny, p.text, chat)
        seq = want + char_ids(p.answer) + [tok.eos_token_id]
        assert inputs[i, :len(seq) - 1].tolist() == seq[:-1] and targets[i, :len(seq) - 1].tolist() == seq[1:]
        # the loss covers exactly the answer and <eos>, not the template
        assert mask[i].nonzero().flatten().tolist() == list(range(len(want) - 1, len(seq) - 1))


def make_run(tmp_path: Path, model: Path, *overrides: str) -> Path:
    from workers.model import load_model, load_tokenizer
    from workers.weights import WeightStore

    small = ["generator.prompts_per_batch=4", "generator.num_generations=4", "generator.flush_groups=4",
             "generator.sampling.max_new_tokens=5", "generator.num_threads=1", "generator.poll_seconds=0.05",
             "generator.max_groups=8", "trainer.max_staleness=none", SPREAD]
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [*small, *overrides]), run / "config.toml")
    write_run_info(run, {"initial_model": str(model), "eval_before": 0.0})
    WeightStore(run / "weights").publish(load_model(model), load_tokenizer(model), 0)
    return run


def test_generator_and_trainer_batch_use_apply_chat_template_ids(tmp_path, tiny):
    from workers.model import load_tokenizer
    from workers.trainer.batch import make_micro_batch, step_batch

    chat = ChatFormat(SYSTEM)
    run = make_run(tmp_path, tiny, "task.chat_template=true", f"task.system_prompt={SYSTEM}")
    # the published weights' folder carries the template the generator loads
    assert (run / "weights" / "v00000000" / "chat_template.jinja").is_file()
    r = run_cli("generate", "--run", str(run), timeout=180)
    assert r.returncode == 0, r.stderr
    db = BufferSQL(run)
    rows = db.query("SELECT prompt, prompt_ids FROM rollouts").to_pylist()
    assert len(rows) == 8 * 4
    train_texts = {p.text for p in load_task(TaskConfig()).train}
    for row in rows:   # the bare text is kept; the ids are the template's
        assert row["prompt"] in train_texts
        assert row["prompt_ids"] == reference_ids(tiny, row["prompt"], chat)

    # the trainer's batch: pulled as the trainer pulls, the model's input starts with those ids
    trainable = db.query("SELECT count(*) n FROM groups WHERE NOT filtered").to_pylist()[0]["n"]
    assert trainable >= 4
    with Sampler(run / "buffer") as sampler:
        pulled = sampler.pull(trainable, trainer_version=0, trainer_step=1, max_staleness=None)
    assert pulled is not None and pulled.table.num_rows == trainable * 4
    batch = step_batch(pulled.table)
    prompts = pulled.table.column("prompt").to_pylist()
    mb = make_micro_batch(batch, list(range(batch.size)), load_tokenizer(tiny).pad_token_id)
    for b, text in enumerate(prompts):
        want = reference_ids(tiny, text, chat)
        assert mb.input_ids[b, :len(want)].tolist() == want
        assert mb.logit_index[b, 0].item() == len(want) - 1     # the first completion token follows the template

    # `asyncgrpo train` checks the buffer against the chat format: plain prompts would not match it
    save_config(load_config(run / "config.toml", ["task.chat_template=false", "task.system_prompt=none"]),
                run / "config.toml")
    r = run_cli("train", "--run", str(run), timeout=180)
    assert r.returncode == 2 and "chat format (task.chat_template)" in r.stderr and "Traceback" not in r.stderr


# -- errors -----------------------------------------------------------------------------------------

def test_a_folder_without_a_template_is_a_model_error(no_template):
    from workers.backends import make_backend
    from workers.model import load_tokenizer

    with pytest.raises(ModelError, match=r"task\.chat_template = true, but the tokenizer in model folder .*"
                                         r"no-template.* has no chat template"):
        make_backend("hf", no_template, chat=ChatFormat())
    with pytest.raises(ModelError, match="has no chat template"):
        encode_prompts(load_tokenizer(no_template), PROMPTS, ChatFormat())
    assert encode_prompts(load_tokenizer(no_template), PROMPTS) == [[VOCAB[BOS]] + char_ids(p) for p in PROMPTS]


def test_a_template_that_refuses_the_system_prompt_is_a_model_error(tmp_path, tiny):
    import shutil

    from workers.chat import check_chat_template
    from workers.model import load_tokenizer

    folder = tmp_path / "no-system"
    shutil.copytree(tiny, folder)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}/{% endfor %}")
    tok = load_tokenizer(folder)
    check_chat_template(tok, ChatFormat(), folder)     # no system prompt: fine
    assert encode_prompts(tok, ["1+2="], ChatFormat()) == [[VOCAB[BOS]] + char_ids("1+2=/")]
    with pytest.raises(ModelError, match=r"chat template of model folder .*no-system.* cannot render a prompt "
                                         r"with task.system_prompt: .*System role not supported"):
        check_chat_template(tok, ChatFormat(SYSTEM), folder)


def test_cli_model_folder_without_a_template_stops_before_anything_starts(tmp_path, no_template):
    run = tmp_path / "r"
    r = run_cli("run", "--run", str(run), "--set", f"model.path={no_template}", "--set", "task.chat_template=true",
                "--set", "run.eval_size=4", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "task.chat_template = true" in r.stderr and str(no_template) in r.stderr
    assert "has no chat template" in r.stderr and "Traceback" not in r.stderr
    assert not run.exists()      # nothing written: no run directory, no daemon started


@pytest.mark.parametrize("sets, words", [
    (["task.system_prompt=be,brief"], ["task.system_prompt = 'be,brief'", "task.chat_template = true"]),
    (["task.chat_template=1"], ["task.chat_template", "expected true or false"]),
    (["task.chat_template=true", "task.system_prompt=Be brief"], ["task.system_prompt = 'Be brief'", "' B'",
                                                                  "model.path"]),
])
def test_cli_bad_chat_settings_name_the_keys(tmp_path, sets, words):
    args = ["run", "--run", str(tmp_path / "r")]
    for s in sets:
        args += ["--set", s]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert all(w in r.stderr for w in words), r.stderr
    assert not (tmp_path / "r").exists()


# -- end to end -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_short_run_with_chat_prompts_trains(tmp_path):
    """The embedded model warm-started on chat prompts (a short fixed warm start, in its own cache),
    then two GRPO steps. A length reward gives groups a spread whatever the accuracy, so the trainer
    gets its groups from a barely trained model."""
    run, cache = tmp_path / "r", tmp_path / "cache"
    sets = ["task.chat_template=true", f"task.system_prompt={SYSTEM}", "task.num_train=400", "task.num_eval=20",
            "warmstart.target_accuracy=none", "warmstart.steps=20", "warmstart.batch_size=32",
            "warmstart.warmup_steps=5", "warmstart.num_threads=1",
            SPREAD,
            "trainer.max_steps=2", "trainer.groups_per_step=4", "trainer.micro_batch_size=16",
            "generator.prompts_per_batch=4", "generator.num_generations=4", "generator.flush_groups=4",
            "generator.sampling.max_new_tokens=6", "run.time_limit_s=none", "run.eval_size=10",
            f"model.cache_dir={cache}"]
    args = [sys.executable, "-m", "pipeline", "run", "--run", str(run)]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["summary"]["step"] == 2
    model = Path(info["initial_model"])
    assert model.parent == cache and (model / "chat_template.jinja").is_file()
    meta = json.loads((model / "asyncgrpo.json").read_text())["warmstart"]
    assert meta["chat"] == {"system_prompt": SYSTEM} and meta["steps"] == 20

    chat = ChatFormat(SYSTEM)
    db = BufferSQL(run)
    assert db.query("SELECT count(*) n FROM consumed").to_pylist()[0]["n"] == 2 * 4
    for row in db.query("SELECT prompt, prompt_ids FROM rollouts JOIN consumed USING (group_id)").to_pylist():
        assert row["prompt_ids"] == reference_ids(model, row["prompt"], chat)
    # every published version keeps the template, so a restarted generator can load it
    for folder in (run / "weights").glob("v*"):
        assert (folder / "chat_template.jinja").is_file(), folder
