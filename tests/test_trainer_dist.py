"""torchrun --nproc_per_node 2 (gloo, CPU) gives the parameters and metrics of one process on the same batches."""

import shutil
import subprocess
import sys

import pytest
import torch

from buffer import BufferSQL
from helpers.trainer_fixtures import (REPO, env, model_folder, newest_checkpoint, sampled,  # noqa: F401
                                      trainer_cmd, write_buffer)
from workers.trainer import config_from_dict, run_trainer

# Uneven splits on purpose: 3 groups x 8 = 24 sequences, 12 per rank, micro-batches of 5 (5+5+2);
# two inner epochs (shuffled within each rank), a KL term with its reference model.
CFG = {"groups_per_step": 3, "max_steps": 2, "micro_batch_size": 5, "num_iterations": 2, "num_threads": 1,
       "lr": 1e-3, "loss": {"beta": 0.05}, "metrics_flush_seconds": 0.0}


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, model_folder):  # noqa: F811
    torch.set_num_threads(1)
    groups = [g for g in sampled(str(model_folder), 12, temperature=0.8)
              if len({c.reward for c in g.completions}) > 1][:6]
    one, two = tmp_path / "one", tmp_path / "two"
    write_buffer(one, groups)
    shutil.copytree(one, two)

    cmd = trainer_cmd(two, model_folder, CFG, "--offline")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cmd[1:]]
    proc = subprocess.run(torchrun, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_trainer(one, config_from_dict(CFG), model_folder=model_folder, offline=True)

    a, b = newest_checkpoint(one), newest_checkpoint(two)
    assert a["step"] == b["step"] == 2 and b["extra"]["world_size"] == 2
    moved = 0.0
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], atol=1e-5, rtol=0, msg=k)
        moved = max(moved, float((a["model"][k] - b["model"][k]).abs().max()))
    q = "SELECT step, grad_norm, \"loss/total\", \"loss/kl\", \"is/mean\", \"clip/frac\", \"batch/sequences\" " \
        "FROM metrics ORDER BY step"
    ma, mb = BufferSQL(one).query(q).to_pylist(), BufferSQL(two).query(q).to_pylist()
    assert len(ma) == len(mb) == 2
    for ra, rb in zip(ma, mb):
        for k in ra:   # the gradient's scale too (Adam alone would hide a sum-versus-mean mistake)
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
    ledger = "SELECT trainer_step, group_id FROM consumed ORDER BY 1, 2"
    assert BufferSQL(one).query(ledger).equals(BufferSQL(two).query(ledger))
    # Only rank 0 wrote: one ledger shard per step, one metrics row per step.
    assert len(list((two / "buffer" / "ledger").glob("step-*.parquet"))) == 2
