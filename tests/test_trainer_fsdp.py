"""trainer.strategy = "fsdp": FSDP2 over 2 gloo ranks (torchrun, CPU) trains as one process does,
resumes exactly after a kill -9, resumes on 1 process, and publishes a complete HF folder."""

import shutil
import subprocess
import sys

import pytest
import torch

from buffer import BufferSQL
from helpers.trainer_fixtures import (REPO, env, model_folder, newest_checkpoint, sampled,  # noqa: F401
                                      trainer_cmd, write_buffer)
from workers.checks import ConfigError
from workers.compactor import oldest_checkpoint_step
from workers.trainer import TrainerConfig, config_from_dict, run_trainer
from workers.trainer.checkpoint import list_checkpoints, load_checkpoint
from workers.weights import WeightStore

# Unequal shares on purpose: 3 groups x G=5 = 15 sequences a step, 8 on rank 0 (micro-batches 7 + 1)
# and 7 on rank 1 (one micro-batch, plus one zero-weight pass). Two inner epochs with the decoupled
# objective (proximal log-probs from epoch 1), a KL term (the reference model is sharded too).
CFG = {"strategy": "fsdp", "groups_per_step": 3, "max_steps": 3, "micro_batch_size": 7, "num_iterations": 2,
       "num_threads": 1, "lr": 1e-3, "loss": {"objective": "decoupled", "beta": 0.05},
       "metrics_flush_seconds": 0.0, "checkpoint_every": 1, "publish_every": 1, "publish_background": False}
METRICS = ('SELECT step, grad_norm, "loss/total", "loss/kl", "is/mean", "kl/new_old", "clip/frac", '
           '"batch/sequences" FROM metrics ORDER BY step')
LEDGER = "SELECT trainer_step, group_id FROM consumed ORDER BY 1, 2"


def _torchrun(run, model, cfg, *flags, script=None, extra_env=None, check=True):
    cmd = trainer_cmd(run, model, cfg, *flags)
    entry = [str(script)] if script is not None else ["-m", "workers.trainer.main"]
    full = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *entry,
            *cmd[3:]]
    proc = subprocess.run(full, cwd=REPO, env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _model_state(path, model_folder):  # noqa: F811
    """The model parameters of a checkpoint (a .dcp folder or a .pt file), as full CPU tensors."""
    if path.suffix == ".pt":
        return load_checkpoint(path)["model"]
    import torch.distributed.checkpoint as dcp

    from workers.model import load_model

    state = {"model": load_model(model_folder).state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def _assert_same(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_folder):  # noqa: F811
    """The same 9 groups trained for 3 steps by 2 FSDP ranks ("two") and by one process ("one")."""
    torch.set_num_threads(1)
    groups = [g for g in sampled(str(model_folder), 24, group_size=5, temperature=0.8)
              if len({c.reward for c in g.completions}) > 1][:9]
    assert len(groups) == 9
    root = tmp_path_factory.mktemp("fsdp")
    one, two = root / "one", root / "two"
    write_buffer(one, groups)
    shutil.copytree(one, root / "buffer-only")
    shutil.copytree(one, two)
    _torchrun(two, model_folder, CFG, "--offline")
    run_trainer(one, config_from_dict({**CFG, "strategy": "ddp"}), model_folder=model_folder, offline=True)
    return root


@pytest.mark.slow
def test_two_fsdp_ranks_equal_one_process(runs, model_folder):  # noqa: F811
    one, two = runs / "one", runs / "two"
    ckpts = list_checkpoints(two / "checkpoints")
    assert [(s, p.name) for s, p in ckpts] == [(2, "step-000000002.dcp"), (3, "step-000000003.dcp")]  # keep 2
    assert sorted(p.name for p in ckpts[-1][1].iterdir()) == ["." + "metadata", "__0_0.distcp", "__1_0.distcp",
                                                             "state.pt"]   # each rank wrote its shards
    state = load_checkpoint(ckpts[-1][1])
    assert state["step"] == state["version"] == 3 and state["extra"]["world_size"] == 2
    assert oldest_checkpoint_step(two) == 2                      # retention sees .dcp folders too
    a = newest_checkpoint(one)["model"]
    b = _model_state(ckpts[-1][1], model_folder)
    _assert_same(a, b, atol=1e-5)
    moved = max(float((a[k] - _model_state_initial(model_folder)[k]).abs().max()) for k in a)
    assert moved > 1e-3                                           # three steps at lr 1e-3 moved the weights
    ma, mb = BufferSQL(one).query(METRICS).to_pylist(), BufferSQL(two).query(METRICS).to_pylist()
    assert [r["step"] for r in mb] == [1, 2, 3] and [r["batch/sequences"] for r in mb] == [15] * 3
    for ra, rb in zip(ma, mb):
        for k in ra:   # grad_norm too: a mean over ranks instead of a sum would halve it
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), k
    assert BufferSQL(one).query(LEDGER).equals(BufferSQL(two).query(LEDGER))


def _model_state_initial(model_folder):  # noqa: F811
    from workers.model import load_model

    return load_model(model_folder).state_dict()


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_step_then_resume_continues_exactly(runs, model_folder):  # noqa: F811
    run = runs / "killed"
    shutil.copytree(runs / "buffer-only", run)
    killed = _torchrun(run, model_folder, CFG, "--offline", script=REPO / "tests" / "helpers" / "fsdp_kill.py",
                       extra_env={"KILL_RANK": "1", "KILL_STEP": "2"}, check=False)
    assert killed.returncode != 0 and "Signal 9" in killed.stderr + killed.stdout, killed.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [1]   # step 2 never finished
    _torchrun(run, model_folder, CFG, "--offline", "--resume")

    two = runs / "two"
    _assert_same(_model_state(list_checkpoints(two / "checkpoints")[-1][1], model_folder),
                 _model_state(list_checkpoints(run / "checkpoints")[-1][1], model_folder), atol=1e-6)
    db = BufferSQL(run)
    assert db.query(LEDGER).equals(BufferSQL(two).query(LEDGER))       # the same groups at the same steps
    counts = db.query("SELECT count(*) n, count(DISTINCT group_id) d FROM consumed").to_pylist()[0]
    assert counts == {"n": 9, "d": 9}                                  # none twice, none skipped
    assert [r["step"] for r in db.query(METRICS).to_pylist()] == [1, 2, 3]
    assert WeightStore(run / "weights").latest() == 3


@pytest.mark.slow
def test_checkpoint_of_two_ranks_resumes_on_one_process(runs, model_folder):  # noqa: F811
    """Resume the 2-rank run from its step-2 checkpoint in one process: step 3 matches one process's."""
    run = runs / "resharded"
    shutil.copytree(runs / "two", run)
    shutil.rmtree(list_checkpoints(run / "checkpoints")[-1][1])        # resume from step 2
    run_trainer(run, config_from_dict(CFG), model_folder=model_folder, offline=True, resume=True)
    ckpts = list_checkpoints(run / "checkpoints")
    assert [s for s, _ in ckpts] == [2, 3] and ckpts[-1][1].suffix == ".dcp"
    assert load_checkpoint(ckpts[-1][1])["extra"]["world_size"] == 1
    _assert_same(newest_checkpoint(runs / "one")["model"], _model_state(ckpts[-1][1], model_folder), atol=1e-5)
    assert BufferSQL(run).query(LEDGER).equals(BufferSQL(runs / "one").query(LEDGER))


@pytest.mark.slow
def test_published_folder_of_fsdp_run_loads_and_generates_like_the_trainer(runs, model_folder):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from workers.model import load_model, load_tokenizer

    two = runs / "two"
    store = WeightStore(two / "weights")
    assert store.latest() == 3 and store.is_complete(3)
    published = AutoModelForCausalLM.from_pretrained(store.folder(3)).eval()
    trainer = load_model(model_folder)
    trainer.load_state_dict(_model_state(list_checkpoints(two / "checkpoints")[-1][1], model_folder))
    trainer.eval()
    _assert_same(trainer.state_dict(), published.state_dict(), atol=0.0)   # bit-exact
    tok = load_tokenizer(store.folder(3))
    batch = tok(["12+34=", "7+8=", "99+1="], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        out_p = published.generate(**batch, **kw)
        out_t = trainer.generate(**batch, **kw)
    assert torch.equal(out_p, out_t) and out_p.shape[1] > batch.input_ids.shape[1]


@pytest.mark.slow
def test_published_folder_of_fsdp_run_runs_in_the_vllm_backend_like_the_trainer(runs, model_folder):  # noqa: F811
    """The folder an FSDP run published, loaded by the vllm backend (vLLM's CPU build here): its greedy
    completions are the trainer model's, and the behaviour log-probs it records are the trainer model's
    log_softmax to 1e-5."""
    from workers.backends import SamplingConfig, make_backend
    from workers.backends.vllm import vllm_available
    from workers.grpo import token_logprobs
    from workers.model import load_model, load_tokenizer

    if vllm_available() is not None:
        pytest.skip(f"vllm does not import: {vllm_available()}")
    from vllm import SamplingParams

    two = runs / "two"
    folder = WeightStore(two / "weights").folder(3)
    trainer = load_model(model_folder)
    trainer.load_state_dict(_model_state(list_checkpoints(two / "checkpoints")[-1][1], model_folder))
    trainer.eval()
    tok = load_tokenizer(folder)
    prompts = ["12+34=", "7+8=", "99+1=", "5*6="]
    backend = make_backend("vllm", folder, seed=0)
    try:
        ids = backend.prompt_token_ids(prompts)
        outs = backend.llm.generate([{"prompt_token_ids": i} for i in ids],
                                    SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        groups = backend.generate(prompts, n=4, sampling=SamplingConfig(temperature=1.0, max_new_tokens=8), seed=3)
    finally:
        backend.close()
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            want = trainer.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                    pad_token_id=tok.pad_token_id)[0, len(prompt_ids):].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == want and len(got) > 0, (got, want)
    worst = 0.0
    for prompt_ids, group in zip(ids, groups):
        for r in group:
            full = torch.tensor([prompt_ids + r.token_ids])
            with torch.no_grad():
                logits = trainer(full).logits[0, len(prompt_ids) - 1:-1]
            ref = token_logprobs(logits, full[0, len(prompt_ids):], 1.0)
            worst = max(worst, (torch.tensor(r.logprobs) - ref).abs().max().item())
    assert worst < 1e-5, worst


@pytest.mark.slow
def test_single_file_checkpoint_resumes_under_fsdp(runs, model_folder):  # noqa: F811
    """A DDP run's step-2 .pt checkpoint (model and AdamW moments) resumed by 2 FSDP ranks: step 3 matches."""
    run = runs / "ddp-to-fsdp"
    shutil.copytree(runs / "one", run)
    list_checkpoints(run / "checkpoints")[-1][1].unlink()              # resume from step 2
    _torchrun(run, model_folder, CFG, "--offline", "--resume")
    ckpts = list_checkpoints(run / "checkpoints")
    assert [(s, p.suffix) for s, p in ckpts] == [(2, ".pt"), (3, ".dcp")]
    _assert_same(newest_checkpoint(runs / "one")["model"], _model_state(ckpts[-1][1], model_folder), atol=1e-5)


@pytest.mark.slow
def test_bfloat16_and_gradient_checkpointing_under_fsdp(runs, model_folder):  # noqa: F811
    """Mixed precision (bfloat16 gathers, float32 reduction and master weights) with recomputed activations;
    the last step's weights and checkpoint are written at the clean exit (every rank takes part)."""
    run = runs / "bf16"
    shutil.copytree(runs / "buffer-only", run)
    _torchrun(run, model_folder, {**CFG, "max_steps": 1, "dtype": "bfloat16", "gradient_checkpointing": True,
                                  "publish_background": True, "publish_every": 100, "checkpoint_every": 100},
              "--offline")
    row = BufferSQL(run).query(METRICS).to_pylist()
    assert len(row) == 1 and row[0]["grad_norm"] > 0 and row[0]["loss/total"] == row[0]["loss/total"]
    state = _model_state(list_checkpoints(run / "checkpoints")[-1][1], model_folder)
    assert all(v.dtype == torch.float32 for v in state.values())
    before = _model_state_initial(model_folder)
    assert max(float((state[k] - before[k]).abs().max()) for k in state) > 1e-4
    published = WeightStore(run / "weights")
    assert published.latest() == 1 and published.is_complete(1)
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [1]


def test_unknown_strategy_is_a_clear_config_error():
    with pytest.raises(ConfigError, match=r"TrainerConfig.strategy must be 'ddp' or 'fsdp', got 'zero3'"):
        TrainerConfig(strategy="zero3")
    with pytest.raises(ConfigError, match="got 'zero3'"):
        config_from_dict({"strategy": "zero3"})
    assert TrainerConfig().strategy == "ddp"


def test_padding_passes_give_every_rank_the_same_number_of_passes():
    from workers.trainer.distributed import Dist
    from workers.trainer.fsdp import padding_passes

    assert [padding_passes(n, 15, 7, 2) for n in (8, 7)] == [0, 1]     # the tests' split: 7 + 1 and 7 + pad
    assert padding_passes(0, 1, 4, 2) == 1                              # a rank with no rows still joins
    for batch in range(1, 40):
        for world in (1, 2, 3, 4):
            for micro in (1, 3, 7):
                rows = [len(range(batch)[Dist(rank=r, world=world).shard(batch)]) for r in range(world)]
                passes = {-(-n // micro) + padding_passes(n, batch, micro, world) for n in rows}
                assert passes == {-(-max(rows) // micro)}, (batch, world, micro)


def test_a_damaged_sharded_checkpoint_is_set_aside_and_the_one_before_is_used(runs, tmp_path):
    """A .dcp folder with a truncated shard file fails at load_checkpoint (not half-way through loading the
    model), so resume takes the checkpoint before it; a second damaged one of the same name is kept too;
    deleting a folder goes through tmp/, so no half-deleted checkpoint keeps its name."""
    from workers.trainer.checkpoint import clean_tmp, remove_after
    from workers.trainer.session import _newest_readable_checkpoint

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(runs / "two" / "checkpoints", ckpt)
    (step2, old), (step3, new) = list_checkpoints(ckpt)
    shard = new / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="__1_0.distcp has 100 bytes"):
        load_checkpoint(new)
    state = _newest_readable_checkpoint(ckpt, list_checkpoints(ckpt))
    assert (state["step"], state["path"]) == (2, old)
    assert sorted(p.name for p in (ckpt / "damaged").iterdir()) == [new.name, f"{new.name}.reason.json"]
    shutil.copytree(old, new)                                    # the same name damaged again
    (new / "__0_0.distcp").unlink()
    assert _newest_readable_checkpoint(ckpt, list_checkpoints(ckpt))["step"] == 2
    assert len([p for p in (ckpt / "damaged").iterdir() if p.name.startswith(new.name) and p.is_dir()]) == 2
    assert remove_after(ckpt, 1) == [old]
    assert list_checkpoints(ckpt) == [] and all(p.name.startswith("deleting-") for p in (ckpt / "tmp").iterdir())
    clean_tmp(ckpt)
    assert list((ckpt / "tmp").iterdir()) == []
