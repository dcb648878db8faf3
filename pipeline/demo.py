"""`asyncgrpo demo`: the buffer end to end with synthetic rollouts and a mock trainer.

No model is involved: completions are random digits and a completion is
"correct" with a probability that grows with the mock policy version, so the
buffer fills with a realistic mix of learnable, all-correct and all-wrong
groups. Each mock step the generator appends a little more than the trainer
consumes, and the trainer pulls within the staleness limit, so some groups
expire and the counts have something to show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import buffer
from buffer.groups import Completion, Group
from buffer.layout import BufferError
from pipeline.status import buffer_status, print_status


def synthetic_group(rng: np.random.Generator, version: int, group_size: int, prompt_no: int,
                    accuracy: float | None = None, spread: tuple[float, float] = (0.3, 1.5)) -> Group:
    """One arithmetic-like group 'a+b=' with `group_size` answers of 2-4 characters (no model).

    Each answer is right with probability accuracy x uniform(spread), so groups differ in
    difficulty; accuracy defaults to min(0.9, 0.2 + 0.05 x version): the mock policy learns.
    """
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    prompt = f"{a}+{b}="
    accuracy = min(0.9, 0.2 + 0.05 * version) if accuracy is None else accuracy
    p_correct = accuracy * rng.uniform(*spread)
    comps = []
    for _ in range(group_size):
        correct = bool(rng.random() < p_correct)
        answer = str(a + b) if correct else str(int(rng.integers(0, 199)))
        ids = np.array([ord(ch) - 40 for ch in answer] + [1], dtype=np.int32)
        comps.append(Completion(text=answer, token_ids=ids,
                                logprobs=rng.uniform(-2.5, -0.01, size=len(ids)).astype(np.float32),
                                reward=float(correct), reward_components={"accuracy": float(correct)},
                                correct=correct))
    return Group(prompt_id=f"arith-{prompt_no}", prompt=prompt,
                 prompt_ids=[ord(ch) - 40 for ch in prompt], version=version,
                 completions=comps, task="synthetic_arithmetic", temperature=1.0)


def run_demo(run_dir: str, *, groups: int, group_size: int, groups_per_step: int,
             max_staleness: int, seed: int, force: bool) -> None:
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    run = Path(run_dir)
    if run.exists():
        if not force:
            raise BufferError(f"{run} already exists; pass --force to replace it, or pick another RUN_DIR")
        shutil.rmtree(run)
    console.print("[bold yellow]asyncgrpo demo[/bold yellow]: SYNTHETIC rollouts and a mock trainer. "
                  "The model, generators and trainer arrive with the pipeline issues; this shows the "
                  "replay buffer they will share.")
    rng = np.random.default_rng(seed)
    buffer_root = run / "buffer"
    writer = buffer.ShardWriter(buffer_root, generator_id="demo-generator", flush_groups=64,
                         flush_seconds=None)
    sampler = buffer.Sampler(buffer_root)
    version, written, pulls, waits = 0, 0, 0, 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("writing and pulling", total=groups)
        while written < groups:
            burst = min(groups - written, int(groups_per_step * 1.5))
            for _ in range(burst):
                writer.append(synthetic_group(rng, version, group_size, written))
                written += 1
            writer.flush()
            batch = sampler.pull(groups_per_step, trainer_version=version, trainer_step=version + 1,
                                 max_staleness=max_staleness)
            if batch is None:
                waits += 1
            else:
                pulls += 1
                version += 1  # the mock optimizer step
            progress.update(task, completed=written,
                            description=f"version {version}, {pulls} pulls")
    writer.close()
    sampler.close()
    r = buffer.compact(buffer_root, min_age_s=0.0, grace_s=0.0)
    console.print(f"wrote {written} groups x {group_size} completions; the mock trainer took "
                  f"{pulls} steps of {groups_per_step} groups ({waits} times it had to wait); "
                  f"compaction merged {r.merged_files} shards into {r.written_files}.")
    print_status(buffer_status(run, trainer_version=version, max_staleness=max_staleness))
    console.print("\nTry next:")
    for q in ("SELECT filter_reason, count(*) FROM groups GROUP BY 1 ORDER BY 2 DESC",
              "SELECT staleness, count(*) FROM consumed GROUP BY 1 ORDER BY 1",
              "SELECT version, round(avg(reward), 3) AS reward FROM rollouts GROUP BY 1 ORDER BY 1"):
        console.print(f"  asyncgrpo sql {run} \"{q}\"", soft_wrap=True, highlight=False)
