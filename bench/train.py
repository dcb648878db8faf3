"""Benchmark of the trainer: seconds per step and tokens per second for the default config on the tiny model.

    python bench/train.py [--steps 20] [--warmup 2] [--threads 2] [--set KEY=VALUE ...] [--dir /tmp] [--keep]

Progress goes to stderr; the last line on stdout is one JSON object:
step_s, tokens_per_s, wait_fraction, forward_s, backward_s (medians over the
timed steps, from the trainer's own metrics rows) and more.

What is measured: `run_trainer(offline=True)` with the default TrainerConfig
(32 groups x G=8 a step, decoupled objective, one inner epoch, micro-batches of
256, AdamW, publishing weights every step) on a fabricated buffer of
(steps + warmup) x 32 groups: prompts "a+b=" (7 tokens with <bos>), completions
of 2-4 tokens like "46<eos>" (the right sum, a near miss or a wrong one, about
a third correct), whose behaviour
log-probs are the tiny model's own (teacher-forced at temperature 1); all-equal
groups are redrawn so every step takes a full batch. Nothing
waits for generators, so wait_fraction measures only the trainer's own
polling overhead. step_s is the trainer's time/step_s: pull, train, publish,
metrics row; tokens_per_s counts prompt and completion tokens over the
training part of the step (time/train_s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP_SIZE = 8


def log(msg: str) -> None:
    print(f"[bench/train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fabricate(run: Path, model_folder: Path, num_groups: int, seed: int = 0) -> None:
    """num_groups groups of G completions into <run>/buffer, none all-equal (each step takes a full batch)."""
    import numpy as np
    import torch

    from buffer import Completion, Group, ShardWriter
    from workers.model import load_model, load_tokenizer

    model, tok = load_model(model_folder), load_tokenizer(model_folder)
    rng = np.random.default_rng(seed)
    vocab = tok.get_vocab()
    ids = lambda text: [vocab[ch] for ch in text]  # noqa: E731 - the tokenizer is one token per character
    drafts = []   # (prompt, prompt ids, [(text, completion ids, reward)])
    for _ in range(num_groups):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        rewards = [0.0]
        while len(set(rewards)) == 1:  # redraw all-equal groups: they would be filtered
            answers = []
            for _ in range(GROUP_SIZE):
                u = rng.random()
                answers.append(a + b if u < 0.35 else a + b + int(rng.integers(1, 10)) if u < 0.7
                               else int(rng.integers(0, 200)))
            rewards = [1.0 if x == a + b else 0.0 for x in answers]
        prompt = f"{a}+{b}="
        drafts.append((prompt, [tok.bos_token_id] + ids(prompt),
                       [(str(x), ids(str(x)) + [tok.eos_token_id], r) for x, r in zip(answers, rewards)]))
    with ShardWriter(run / "buffer", generator_id="bench", flush_groups=64, flush_seconds=None) as w:
        for start in range(0, num_groups, 64):  # teacher-force 64 groups (512 sequences) at a time
            chunk = drafts[start:start + 64]
            seqs = [pids + c for _, pids, comps in chunk for _, c, _ in comps]
            width = max(len(s) for s in seqs)
            x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])       # (R, L) right-padded
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)     # (R, L-1, V)
            row = 0
            for k, (prompt, pids, comps) in enumerate(chunk):
                completions = []
                for text, c, r in comps:
                    pos = torch.arange(len(pids) - 1, len(pids) - 1 + len(c))
                    lps = logp[row, pos, torch.tensor(c)].tolist()
                    completions.append(Completion(text=text, token_ids=c, logprobs=lps, reward=r,
                                                  reward_components={"accuracy": r}, correct=bool(r)))
                    row += 1
                w.append(Group(prompt_id=f"p{start + k}", prompt=prompt, prompt_ids=pids, version=0,
                               completions=completions, task="arithmetic"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="Timed steps.")
    p.add_argument("--warmup", type=int, default=2, help="Untimed first steps.")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainerConfig override as JSON value, e.g. --set micro_batch_size=64")
    p.add_argument("--dir", default=None, help="Where to make the scratch run (default: a temp dir).")
    p.add_argument("--keep", action="store_true", help="Keep the scratch run.")
    args = p.parse_args()

    import torch

    from buffer import BufferSQL
    from workers.model import init_model
    from workers.trainer import config_from_dict, run_trainer

    torch.set_num_threads(args.threads)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = config_from_dict({**overrides, "num_threads": args.threads, "checkpoint_every": 10_000})
    scratch = Path(tempfile.mkdtemp(prefix="bench-train-", dir=args.dir))
    try:
        t0 = time.time()
        model = init_model(scratch / "model")
        total = args.steps + args.warmup
        fabricate(scratch / "run", model, total * cfg.groups_per_step)
        log(f"fabricated {total * cfg.groups_per_step} groups in {time.time() - t0:.1f} s; training {total} steps")
        run_trainer(scratch / "run", replace_max_steps(cfg, total), model_folder=model, offline=True)
        rows = BufferSQL(scratch / "run").query("SELECT * FROM metrics ORDER BY step").to_pylist()
        timed = [r for r in rows if r["step"] > args.warmup]
        med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
        result = {
            "step_s": med("time/step_s"), "tokens_per_s": med("perf/tokens_per_s"),
            "wait_fraction": sum(r["time/wait_s"] for r in timed) / sum(r["time/step_s"] for r in timed),
            "forward_s": med("time/forward_s"), "backward_s": med("time/backward_s"),
            "optim_s": med("time/optim_s"), "pull_s": med("time/pull_s"), "publish_s": med("time/publish_s"),
            "train_s": med("time/train_s"), "sequences": med("batch/sequences"), "tokens": med("batch/tokens"),
            "steps": len(timed), "threads": args.threads, "groups_per_step": cfg.groups_per_step,
            "micro_batch_size": cfg.micro_batch_size, "objective": cfg.loss.objective,
            "publish_every": cfg.publish_every,
        }
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    finally:
        if args.keep:
            log(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def replace_max_steps(cfg, steps: int):
    from dataclasses import replace

    return replace(cfg, max_steps=steps)


if __name__ == "__main__":
    main()
