"""The transformers backend against teacher forcing and HF generate, on the tiny random model."""

from __future__ import annotations

import math

import pytest
import torch

from workers.backends import BackendError, Rollout, SamplingConfig, make_backend
from workers.backends.hf import HFBackend, truncate_logits
from workers.checks import ConfigError
from workers.grpo import token_logprobs
from workers.model import init_model

torch.set_num_threads(1)

PROMPTS = ["12+34=", "5*6=", "123+4567=", "7-"]  # different lengths: left padding is exercised


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_models")
    return init_model(root / "m0", seed=0), init_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def backend(model_folders) -> HFBackend:
    b = make_backend("hf", model_folders[0], seed=0)
    yield b
    b.close()


def teacher_forced(model, prompt_ids: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, from one forward pass over prompt + completion."""
    full = torch.tensor([prompt_ids + completion])                     # (1, P+C)
    with torch.no_grad():
        logits = model(full).logits[0, :-1]                            # (P+C-1, V), shifted
    P = len(prompt_ids)
    return token_logprobs(logits[P - 1:], full[0, P:], temperature)    # (C,)


# -- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", 0), ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", 0), ("top_k", 2.5), ("max_new_tokens", 0), ("max_new_tokens", True)])
def test_sampling_config_rejects(field, value):
    with pytest.raises(ConfigError, match=f"SamplingConfig.{field} must be"):
        SamplingConfig(**{field: value})


def test_sampling_config_defaults_and_truncated():
    cfg = SamplingConfig()
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens) == (1.0, 1.0, None, 16)
    assert not cfg.truncated
    assert SamplingConfig(top_p=0.9).truncated and SamplingConfig(top_k=5).truncated


def test_truncate_logits_exact():
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda **kw: torch.isfinite(truncate_logits(z, **kw))[0].tolist()   # noqa: E731
    assert kept(top_p=1.0, top_k=None) == [True, True, True, True]
    assert kept(top_p=0.4, top_k=None) == [True, False, False, False]
    assert kept(top_p=0.75, top_k=None) == [True, True, False, False]
    assert kept(top_p=0.81, top_k=None) == [True, True, True, False]
    assert kept(top_p=1.0, top_k=2) == [True, True, False, False]
    assert kept(top_p=0.4, top_k=3) == [True, False, False, False]
    # top-p over the top-k renormalised mass: 0.5/0.8 = 0.625 < 0.7, so the second token stays
    assert kept(top_p=0.7, top_k=2) == [True, True, False, False]
    # a permuted row keeps the same tokens
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.isfinite(truncate_logits(z[:, perm], 0.75, None))[0].tolist() == [False, True, False, True]


# -- behaviour log-probs --------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=1.0, max_new_tokens=12),
    SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12),
    SamplingConfig(temperature=1.6, top_k=5, max_new_tokens=6)])
def test_logprobs_equal_teacher_forced_recomputation(backend, sampling):
    groups = backend.generate(PROMPTS, n=4, sampling=sampling, seed=123)
    prompt_ids = backend.prompt_token_ids(PROMPTS)
    assert len(groups) == len(PROMPTS) and all(len(g) == 4 for g in groups)
    worst = 0.0
    for ids, group in zip(prompt_ids, groups):
        for r in group:
            assert len(r.logprobs) == len(r.token_ids) >= 1
            ref = teacher_forced(backend.model, ids, r.token_ids, sampling.temperature)
            worst = max(worst, (torch.tensor(r.logprobs) - ref).abs().max().item())
    assert worst < 1e-5, worst


def test_top_k_draws_only_from_the_k_most_likely(backend):
    sampling = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=8)
    groups = backend.generate(PROMPTS[:2], n=8, sampling=sampling, seed=5)
    for ids, group in zip(backend.prompt_token_ids(PROMPTS[:2]), groups):
        for r in group:
            full = torch.tensor([ids + r.token_ids])
            with torch.no_grad():
                logits = backend.model(full).logits[0, len(ids) - 1:-1]      # (C, V)
            top3 = logits.topk(3, dim=-1).indices
            assert all(t in top3[i].tolist() for i, t in enumerate(r.token_ids))


# -- greedy, padding, batching --------------------------------------------------------------------

def test_greedy_equals_hf_generate(backend):
    greedy = SamplingConfig(top_k=1, max_new_tokens=10)
    groups = backend.generate(PROMPTS, n=2, sampling=greedy, seed=0)
    for ids, group in zip(backend.prompt_token_ids(PROMPTS), groups):
        with torch.no_grad():
            ref = backend.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         do_sample=False, max_new_tokens=10, eos_token_id=backend.eos_id,
                                         pad_token_id=backend.pad_id)[0, len(ids):].tolist()
        if backend.eos_id in ref:
            ref = ref[:ref.index(backend.eos_id) + 1]
        assert [r.token_ids for r in group] == [ref, ref]


def test_padding_does_not_change_outputs(backend):
    greedy = SamplingConfig(top_k=1, max_new_tokens=10)
    alone = backend.generate(["1+2="], n=1, sampling=greedy, seed=0)[0][0]
    batched = backend.generate(["123456789+987654321=", "1+2="], n=1, sampling=greedy, seed=0)[1][0]
    assert batched.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-5


def test_max_sequences_splits_batches_without_changing_greedy_outputs(model_folders, backend):
    greedy = SamplingConfig(top_k=1, max_new_tokens=8)
    small = HFBackend(model_folders[0], max_sequences=3)
    got = small.generate(PROMPTS, n=2, sampling=greedy, seed=0)
    want = backend.generate(PROMPTS, n=2, sampling=greedy, seed=0)
    assert [[r.token_ids for r in g] for g in got] == [[r.token_ids for r in g] for g in want]


def test_prompt_ids_are_kept_and_equal_the_tokenizers(model_folders, monkeypatch):
    import workers.backends.hf as hf
    b = HFBackend(model_folders[0])
    calls = []
    real = hf.encode_prompts
    monkeypatch.setattr(hf, "encode_prompts", lambda tok, texts, chat: calls.append(list(texts)) or real(tok, texts, chat))
    monkeypatch.setattr(hf, "PROMPT_IDS_CACHE", 4)
    texts = ["12+34=", "5*6=", "12+34=", "7-"]
    want = real(b.tokenizer, texts, None)
    assert b.prompt_token_ids(texts) == want and calls == [["12+34=", "5*6=", "7-"]]   # each text once
    got = b.prompt_token_ids(texts)
    got[0].append(99)                                  # a caller's list is its own
    assert b.prompt_token_ids(texts) == want and len(calls) == 1
    assert b.prompt_token_ids(["1+1=", "2+2="]) == real(b.tokenizer, ["1+1=", "2+2="], None)
    assert calls[-1] == ["1+1=", "2+2="] and len(b._prompt_ids) == 2               # 3 + 2 > 4: dropped first


def test_each_prompt_is_prefilled_once(backend):
    shapes = []
    hook = backend.model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        backend.generate(PROMPTS, n=8, sampling=SamplingConfig(max_new_tokens=5), seed=1)
    finally:
        hook.remove()
    P = max(len(ids) for ids in backend.prompt_token_ids(PROMPTS))
    assert shapes[0] == (len(PROMPTS), P)                    # one prefill of N rows, not N*G
    assert len(shapes) <= 5 and all(s[1] == 1 and s[0] <= len(PROMPTS) * 8 for s in shapes[1:])


@pytest.mark.parametrize("shared", [True, False])
def test_finished_rows_leave_the_decode_batch(model_folders, shared):
    # Each decode forward carries exactly the rows that have not sampled a stop token yet, and
    # the log-probs still equal a teacher-forced pass: the kept rows' caches (the shared prefix
    # with its scattered queries, or the copied cache's selected rows) are theirs.
    b = HFBackend(model_folders[0])
    b.prefix_sharing = shared
    rows = []
    hook = b.model.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    try:
        groups = b.generate(PROMPTS, n=32, sampling=sampling, seed=11)
    finally:
        hook.remove()
    lengths = [len(r.token_ids) for g in groups for r in g]
    # the forward after sampling position t carries the rows longer than t + 1 tokens
    want = [sum(n > t + 1 for n in lengths) for t in range(max(lengths) - 1)]
    assert rows[1:] == want and want[-1] < want[0] < len(lengths)
    worst = max((torch.tensor(r.logprobs) - teacher_forced(b.model, ids, r.token_ids, 1.0)).abs().max().item()
                for ids, g in zip(b.prompt_token_ids(PROMPTS), groups) for r in g)
    assert worst < 1e-5, worst


# -- seeds, stopping ------------------------------------------------------------------------------

def test_seed_reproduces_and_differs(model_folders, backend):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    a = backend.generate(PROMPTS, n=4, sampling=sampling, seed=7)
    b = backend.generate(PROMPTS, n=4, sampling=sampling, seed=7)
    c = backend.generate(PROMPTS, n=4, sampling=sampling, seed=8)
    assert a == b
    assert [[r.token_ids for r in g] for g in a] != [[r.token_ids for r in g] for g in c]
    # seed=None draws from the backend's own generator: two backends with one seed agree
    x = HFBackend(model_folders[0], seed=3).generate(PROMPTS, n=2, sampling=sampling)
    y = HFBackend(model_folders[0], seed=3).generate(PROMPTS, n=2, sampling=sampling)
    assert x == y


def test_eos_stops_a_row_and_finish_reasons(backend):
    # The random model puts about 1/64 on <eos> at every step, so 128 rows of 24 tokens
    # give both outcomes (fixed seed).
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    groups = backend.generate(PROMPTS, n=32, sampling=sampling, seed=11)
    reasons = {"stop": 0, "length": 0}
    for group in groups:
        for r in group:
            assert isinstance(r, Rollout)
            reasons[r.finish_reason] += 1
            eos_at = [i for i, t in enumerate(r.token_ids) if t == backend.eos_id]
            if r.finish_reason == "stop":
                assert eos_at == [len(r.token_ids) - 1] and len(r.token_ids) <= 24
            else:
                assert eos_at == [] and len(r.token_ids) == 24
            assert r.text == backend.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            assert "<eos>" not in r.text and "<pad>" not in r.text
    assert reasons["stop"] > 5 and reasons["length"] > 5, reasons


def test_one_token_completions(backend):
    groups = backend.generate(PROMPTS[:2], n=3, sampling=SamplingConfig(max_new_tokens=1), seed=0)
    for r in (r for g in groups for r in g):
        assert len(r.token_ids) == 1 and len(r.logprobs) == 1
        assert r.finish_reason == ("stop" if r.token_ids == [backend.eos_id] else "length")


# -- weights, errors ------------------------------------------------------------------------------

def test_load_weights_changes_outputs_in_place(model_folders):
    m0, m1 = model_folders
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    b = HFBackend(m0)
    before = b.generate(PROMPTS, n=2, sampling=sampling, seed=4)
    model_id = id(b.model)
    b.load_weights(m1)
    after = b.generate(PROMPTS, n=2, sampling=sampling, seed=4)
    assert id(b.model) == model_id
    assert [r.logprobs for g in before for r in g] != [r.logprobs for g in after for r in g]
    assert after == HFBackend(m1).generate(PROMPTS, n=2, sampling=sampling, seed=4)
    b.load_weights(m0)
    assert b.generate(PROMPTS, n=2, sampling=sampling, seed=4) == before


def test_load_weights_rejects_other_shapes(tmp_path, backend):
    from workers.model import TinyModelSpec
    other = init_model(tmp_path / "wide", spec=TinyModelSpec(hidden_size=64, intermediate_size=128))
    with pytest.raises(BackendError, match="do not fit the loaded model"):
        backend.load_weights(other)


def test_errors_name_the_bad_value(backend):
    with pytest.raises(ValueError, match="got 0"):
        backend.generate(PROMPTS, n=0, sampling=SamplingConfig())
    with pytest.raises(TypeError, match="list of strings"):
        backend.generate("12+3=", n=1, sampling=SamplingConfig())
    with pytest.raises(BackendError, match="exceeds the model's maximum length 512"):
        backend.generate(["1" * 500], n=1, sampling=SamplingConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match="backend kind must be one of hf, vllm, got 'tgi'"):
        make_backend("tgi", "/nonexistent")
    assert backend.generate([], n=2, sampling=SamplingConfig()) == []
    assert math.isfinite(backend.generate(["1"], n=1, sampling=SamplingConfig(max_new_tokens=1))[0][0].logprobs[0])


def test_cache_copy_fallback_gives_the_same_rollouts(model_folders, backend):
    # Models with sliding-window or soft-capped attention decode through a copied cache
    # (batch_repeat_interleave); both paths must sample the same tokens with the same log-probs.
    copy = HFBackend(model_folders[0])
    copy.prefix_sharing = False
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=10)
    want = backend.generate(PROMPTS, n=4, sampling=sampling, seed=21)
    got = copy.generate(PROMPTS, n=4, sampling=sampling, seed=21)
    assert [[r.token_ids for r in g] for g in got] == [[r.token_ids for r in g] for g in want]
    worst = max(abs(a - b) for g, h in zip(got, want) for r, s in zip(g, h) for a, b in zip(r.logprobs, s.logprobs))
    assert worst < 1e-5
    assert backend.prefix_sharing and backend.model.config._attn_implementation == "sdpa"


def test_kept_decode_buffers_change_nothing_and_are_reused(model_folders):
    # The decode loop's key/value buffers are kept between calls (SuffixPool): a call after a
    # larger one decodes in the first rows/positions of its buffers, with stale values beyond
    # them. Every call must equal the same call on a backend that has made no other.
    kept = HFBackend(model_folders[0])
    calls = [(PROMPTS, 8, 12), (PROMPTS[:2], 3, 12), (PROMPTS, 2, 5), (PROMPTS[1:], 8, 20), (PROMPTS[:1], 1, 4)]
    ptrs = []
    for i, (prompts, n, T) in enumerate(calls):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=T)
        got = kept.generate(prompts, n=n, sampling=sampling, seed=i)
        want = HFBackend(model_folders[0]).generate(prompts, n=n, sampling=sampling, seed=i)
        assert got == want, i                              # token ids, log-probs and texts, exactly
        ptrs.append(kept._pool._buffers[0][0].data_ptr())
        assert kept._pool._buffers[0][0].shape[:3:2] == (max(len(p) * k for p, k, _ in calls[:i + 1]),
                                                         max(t for _, _, t in calls[:i + 1]))
    assert ptrs[0] == ptrs[1] == ptrs[2] and ptrs[3] == ptrs[4]  # reused, grown once (more positions)


def test_grouped_query_attention_model(tmp_path):
    # 4 query heads sharing 2 key/value heads: the shared-prefix attention regroups queries per kv head
    from workers.model import TinyModelSpec
    folder = init_model(tmp_path / "gqa", spec=TinyModelSpec(num_key_value_heads=2, num_hidden_layers=2))
    b = HFBackend(folder)
    assert b.prefix_sharing and b.model.config.num_key_value_heads == 2
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=8)
    groups = b.generate(PROMPTS, n=3, sampling=sampling, seed=2)
    worst = max((torch.tensor(r.logprobs) - teacher_forced(b.model, ids, r.token_ids, 0.8)).abs().max().item()
                for ids, g in zip(b.prompt_token_ids(PROMPTS), groups) for r in g)
    assert worst < 1e-5, worst
