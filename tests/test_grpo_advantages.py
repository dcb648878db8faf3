"""group_advantages: hand values, all-equal groups, agreement with the buffer's numpy formula."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.groups import group_reward_stats, reward_stats
from workers.grpo import group_advantages


def test_lecture_example_population_and_sample():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    pop = group_advantages(r, std="population")
    sample = group_advantages(r, std="sample")
    # population std 0.5; sample std sqrt(1/3)
    assert pop[0].tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5)
    assert pop[0].tolist() == pytest.approx([0.5 / (0.5 + 1e-6) * s for s in (1, -1, 1, -1)], abs=1e-15)
    assert sample[0].tolist() == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)
    sd = math.sqrt(1 / 3)
    assert sample[0].tolist() == pytest.approx([0.5 / (sd + 1e-6) * s for s in (1, -1, 1, -1)], abs=1e-15)


def test_std_none_is_dr_grpo_centring():
    r = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 6.0]], dtype=torch.float64)
    assert group_advantages(r, std="none").tolist() == [[1.0, -1.0, 0.0], [-2.0, -2.0, 4.0]]


def test_hand_values_two_groups_and_custom_eps():
    r = torch.tensor([[2.0, 0.0], [1.0, 4.0]], dtype=torch.float64)
    # group 0: mean 1, sample std sqrt(2), population std 1; group 1: mean 2.5, sample std 1.5*sqrt(2), pop 1.5
    got = group_advantages(r, std="sample", eps=0.5)
    s0, s1 = math.sqrt(2), 1.5 * math.sqrt(2)
    assert got.flatten().tolist() == pytest.approx(
        [1 / (s0 + 0.5), -1 / (s0 + 0.5), -1.5 / (s1 + 0.5), 1.5 / (s1 + 0.5)], abs=1e-15)
    got = group_advantages(r, std="population", eps=0.0)
    assert got.tolist() == [[1.0, -1.0], [-1.0, 1.0]]


@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_all_equal_group_gives_zeros_not_nan(std):
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float32)
    got = group_advantages(r, std=std, eps=0.0)
    assert got[:2].tolist() == [[0.0] * 3, [0.0] * 3]
    assert torch.isfinite(got).all() and got[2].abs().sum() > 0
    # G = 1: a one-completion group is all-equal, even for the sample std (ddof 1)
    assert group_advantages(torch.tensor([[5.0], [2.0]]), std=std).tolist() == [[0.0], [0.0]]


def test_flat_rewards_with_num_generations_and_integer_rewards():
    flat = torch.tensor([1, 0, 1, 0, 2, 2, 2, 2])            # (B,) = N * G with G = 4, integers
    got = group_advantages(flat, std="population", num_generations=4)
    assert got.shape == (8,) and got.dtype == torch.float32
    assert got.tolist() == pytest.approx([1, -1, 1, -1, 0, 0, 0, 0], abs=1e-5)
    assert torch.equal(got.reshape(2, 4), group_advantages(flat.reshape(2, 4), std="population"))


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(-10, 10), min_size=4, max_size=4),
                       min_size=1, max_size=6),
       std=st.sampled_from(["sample", "population", "none"]))
def test_agrees_with_buffer_group_reward_stats(groups, std):
    r = torch.tensor(groups, dtype=torch.float64)                        # (N, G)
    got = group_advantages(r, std=std).numpy()
    want = np.stack([group_reward_stats(g, std=std)[2] for g in groups])   # float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_agrees_with_buffer_on_random_rewards(std):
    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.normal(size=(30, 4)), rng.integers(0, 2, size=(30, 4)).astype(float),
                              np.full((1, 4), 0.3)])
    got = group_advantages(torch.from_numpy(rewards), std=std).numpy()
    want = np.stack([group_reward_stats(g, std=std)[2] for g in rewards])
    assert (want == 0).all(axis=1).sum() > 0          # some binary groups are all-equal
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _random_reward_rows(rng: np.random.Generator, n: int, g: int) -> np.ndarray:
    """(n, g) rewards of the kinds groups have: continuous at several scales, binary, a few levels,
    and rows that are all equal."""
    rows = np.concatenate([rng.normal(size=(n, g)) * 10.0 ** rng.uniform(-2, 2, size=(n, 1)),
                           rng.integers(0, 2, size=(n, g)).astype(np.float64),
                           rng.choice([0.0, 0.5, 1.0], size=(n, g)),
                           np.repeat(rng.uniform(-10, 10, size=(n, 1)), g, axis=1)])
    return rows[rng.permutation(len(rows))]


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.3])
@pytest.mark.parametrize("std", ["sample", "population", "none"])
def test_buffer_formula_matches_torch_on_many_random_groups(std, eps):
    """buffer.groups.reward_stats (numpy, stored at append time) and group_advantages (torch, the
    trainer's) are one formula: in float64 they differ only by summation order, within 1e-12 of
    max(1, |A|); all-equal groups (G = 1 included) are exactly 0 in both."""
    rng = np.random.default_rng(7)
    checked = all_equal_rows = 0
    for g in (1, 2, 3, 4, 8, 16, 64):
        rewards = _random_reward_rows(rng, 25, g)                             # (N, G)
        _, _, want, all_equal = reward_stats(rewards, std=std, eps=eps)
        got = group_advantages(torch.from_numpy(rewards), std=std, eps=eps).numpy()
        assert got.dtype == want.dtype == np.float64 and got.shape == want.shape == rewards.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert (got[all_equal] == 0).all() and (want[all_equal] == 0).all()
        assert np.isfinite(want).all() and np.isfinite(got).all()
        checked += len(rewards)
        all_equal_rows += int(all_equal.sum())
    assert checked == 7 * 100 and all_equal_rows >= 7 * 25     # every G = 1 row, and every constant row


@pytest.mark.parametrize("kwargs, field, value", [
    ({"std": "stdev"}, "std", "'stdev'"),
    ({"eps": -1e-3}, "eps", "-0.001"),
    ({"eps": float("nan")}, "eps", "nan"),
    ({"num_generations": 0}, "num_generations", "0"),
    ({"num_generations": 3}, "num_generations", "3"),
])
def test_bad_arguments_name_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        group_advantages(torch.zeros(8), **({"num_generations": 4} | kwargs))


def test_wrong_rank_is_an_error():
    with pytest.raises(ValueError, match=r"\(N, G\).*\(2, 2, 2\)"):
        group_advantages(torch.zeros(2, 2, 2))
