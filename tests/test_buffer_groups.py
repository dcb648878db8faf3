"""buffer.groups: one advantage formula for one group and for a whole flush; StdMode's one home."""

import subprocess
import sys

import numpy as np
import pytest

from buffer import BufferError, ShardWriter
from buffer.groups import STD_MODES, group_reward_stats, ragged_reward_stats, reward_stats
from conftest import REPO


def test_reward_stats_hand_values():
    r = np.array([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [3.0, 1.0, 2.0, 2.0]])   # (N, G) = (3, 4)
    mean, sd, adv, equal = reward_stats(r, std="population", eps=0.0)
    assert mean.tolist() == [0.5, 2.0, 2.0] and equal.tolist() == [False, True, False]
    assert sd.tolist() == [0.5, 0.0, np.sqrt(0.5)]
    assert adv[:2].tolist() == [[1.0, -1.0, 1.0, -1.0], [0.0] * 4]
    _, sd, adv, _ = reward_stats(r, std="none")      # Dr. GRPO: centred only; the std is still reported
    assert sd.tolist() == [0.5, 0.0, np.sqrt(0.5)] and adv.tolist() == [[0.5, -0.5, 0.5, -0.5], [0.0] * 4,
                                                                        [1.0, -1.0, 0.0, 0.0]]


@pytest.mark.parametrize("std", STD_MODES)
def test_ragged_stats_are_the_per_group_stats_bit_for_bit(std):
    rng = np.random.default_rng(3)
    sizes = rng.choice([1, 2, 3, 4, 8, 9], size=60)                  # (P,), G = 1 included
    rewards = rng.normal(size=int(sizes.sum()))                       # (R,)
    rewards[rng.random(len(rewards)) < 0.4] = 1.0                     # some all-equal groups
    mean, sd, adv, equal = ragged_reward_stats(rewards, sizes, std=std, eps=1e-6)
    assert adv.dtype == np.float32 and len(adv) == len(rewards) and len(mean) == len(sizes)
    start = 0
    for k, size in enumerate(sizes.tolist()):
        want = group_reward_stats(rewards[start:start + size], std=std, eps=1e-6)
        assert (mean[k], sd[k]) == want[:2] and np.array_equal(adv[start:start + size], want[2])
        assert equal[k] == (rewards[start:start + size].min() == rewards[start:start + size].max())
        start += size
    assert equal.sum() > 0 and (~equal).sum() > 0 and (sizes == 1).any()


def test_std_mode_has_one_home():
    import buffer.groups
    import workers.grpo
    import workers.trainer.config

    for where in (workers.grpo, workers.trainer.config):
        assert where.StdMode is buffer.groups.StdMode and where.STD_MODES is buffer.groups.STD_MODES


def test_shard_writer_rejects_an_unknown_std_mode(tmp_path):
    with pytest.raises(BufferError, match=r"advantage_std must be one of .*'sample'.* got 'stdev'"):
        ShardWriter(tmp_path / "buf", advantage_std="stdev")


def test_std_modes_load_without_pyarrow_duckdb_or_torch():
    """Config checks reach StdMode through workers.grpo.options; that must not load the storage code."""
    code = ("import sys, workers.grpo.options, buffer.groups; "
            "print(sorted(m for m in ('pyarrow', 'duckdb', 'torch', 'filelock') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
