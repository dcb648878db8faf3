"""token_logprobs and entropy_from_logits: hand values, agreement with log_softmax, gradients."""

import math

import pytest
import torch

from workers.grpo import entropy_from_logits, token_logprobs


def test_hand_values_with_temperature():
    # p = softmax([0, ln 3]) = [1/4, 3/4]; at T = 2 the logits [0, 2 ln 3] give the same distribution
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 2 * math.log(3)]]], dtype=torch.float64)   # (1, 2, 2)
    tokens = torch.tensor([[1, 0]])
    assert token_logprobs(logits[:, :1], tokens[:, :1]).item() == pytest.approx(math.log(0.75), abs=1e-15)
    got = token_logprobs(logits[:, 1:], tokens[:, 1:], temperature=2.0)
    assert got.tolist()[0] == pytest.approx([math.log(0.25)], abs=1e-15)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits[:, :1]).item() == pytest.approx(h, abs=1e-15)
    assert entropy_from_logits(logits[:, 1:], temperature=2.0).item() == pytest.approx(h, abs=1e-15)
    assert entropy_from_logits(torch.zeros(3, 64)).tolist() == pytest.approx([math.log(64)] * 3, abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_and_its_gradient(chunk_rows, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)   # (B, T, V)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    got = token_logprobs(logits, tokens, temperature, chunk_rows)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    ent = entropy_from_logits(logits, temperature, chunk_rows)
    p = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=0, atol=1e-12)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.8, chunk_rows=4), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 1.3, chunk_rows=4), (logits,))


def test_bfloat16_logits_are_upcast_and_grad_keeps_dtype():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 50, generator=g).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (2, 4), generator=g)
    got = token_logprobs(logits, tokens, chunk_rows=3)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_masked_vocabulary_entries_are_fine():
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]], requires_grad=True)   # (T=1, V=4)
    lp = token_logprobs(logits, torch.tensor([1]))
    lp.sum().backward()
    assert lp.item() == pytest.approx(math.log(0.5))
    assert logits.grad.tolist() == [[-0.5, 0.5, 0.0, 0.0]]
    assert entropy_from_logits(logits.detach()).item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("kwargs, field, value", [
    ({"temperature": 0.0}, "temperature", "0.0"),
    ({"temperature": float("inf")}, "temperature", "inf"),
    ({"chunk_rows": 0}, "chunk_rows", "0"),
])
def test_bad_arguments_name_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        entropy_from_logits(torch.zeros(1, 2, 3), **kwargs)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"\(1, 2, 3\).*\(1, 3\)"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
