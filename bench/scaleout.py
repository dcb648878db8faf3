"""Scale-out benchmark (issue 17): per-rank training memory of DDP against FSDP2, FSDP's publish time, and
the Ray launcher's start-up and shut-down overhead against the local one.

    python bench/scaleout.py [--ranks 2] [--layers 8] [--hidden 768] [--intermediate 2048]
                             [--steps 2] [--seq 64] [--launches 3] [--no-memory] [--dir /tmp] [--keep]

A Qwen2-style model built from a config with random weights (no download;
the default shape has about 57M parameters, `params` in the output), saved
once as an HF folder. For each strategy, `torchrun --nproc_per_node RANKS`
runs this file as a worker (gloo, CPU):

    load the folder; "fsdp": workers.trainer.fsdp.shard_model (fully_shard per
        decoder layer + root, the trainer's own code); "ddp": the whole model on
        every rank (the trainer's explicit all-reduce, Dist.all_reduce_grads)
    STEPS optimizer steps of AdamW on random tokens (batch 2 x SEQ, cross-entropy)
    per rank: bytes of parameters, gradients and AdamW state this rank holds
        (the local shards of DTensors), and peak resident memory (ru_maxrss)
    publish one version as the trainer does: "fsdp": fsdp.full_state_dict (gathered
        to rank 0, CPU-offloaded) + Publisher(gathered=True); "ddp": Publisher on
        the model's state dict; seconds on rank 0, folder loaded back to check it

The training loss is plain cross-entropy, not the GRPO objective: the memory
of parameters, gradients and optimizer state does not depend on the loss.

Launchers (`--launches N` times each, alternating local and ray; 0 skips it):
`asyncgrpo run configs/default.toml --launcher local|ray` on the embedded tiny
model (its warm start cached in runs/.cache), 3 trainer steps, 20 evaluation
prompts. From the command's own output, timed as its lines arrive:
    startup_s    command start -> "started the trainer ..." (Ray: ray.init of a
                 local instance, actors placed; local: processes spawned; both
                 include the accuracy evaluation before training, the same work)
    run_s        "started ..." -> "stopping ..." (the 3 steps)
    shutdown_s   "stopping ..." -> exit (daemons stopped, evaluation after, plots;
                 Ray: the local instance shut down)
    wall_s       the whole command
Medians per launcher, and ray - local differences (the overhead).
Progress goes to stderr; the last line on stdout is one JSON object with
each figure per strategy (max over ranks) and FSDP / DDP ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MB = 2 ** 20


def log(msg: str) -> None:
    print(f"[bench/scaleout {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    import torch

    from workers.model import load_model, load_tokenizer
    from workers.trainer.distributed import init_dist
    from workers.trainer.fsdp import full_state_dict, shard_model
    from workers.trainer.publisher import Publisher
    from workers.weights import WeightStore

    torch.set_num_threads(1)
    dist = init_dist("cpu", args.strategy)
    torch.manual_seed(dist.rank)
    model = load_model(args.model, dtype="float32", device="cpu")
    if dist.sharded:
        shard_model(model, world=dist.world, device=torch.device("cpu"), dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (2, args.seq))
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        if not dist.sharded:
            dist.all_reduce_grads(params)
        opt.step()
        grads = _local_bytes(p.grad for p in params)   # held until zero_grad: measured at their peak
        opt.zero_grad(set_to_none=True)
    step_s = (time.perf_counter() - t0) / args.steps
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    mine = {"params_mb": _local_bytes(params) / MB, "grads_mb": grads / MB, "optimizer_mb": _local_bytes(state) / MB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "step_s": step_s}
    mine["train_state_mb"] = mine["params_mb"] + mine["grads_mb"] + mine["optimizer_mb"]
    publisher = None
    if dist.is_main:
        store = WeightStore(Path(args.out) / "weights", source=args.model)
        publisher = Publisher(store, Path(args.model), load_tokenizer(args.model), keep=2, background=False,
                              gathered=dist.sharded)
    t0 = time.perf_counter()
    sd = full_state_dict(model) if dist.sharded else model.state_dict()
    if dist.is_main:
        publisher.publish(sd, 1, wait=True)
    del sd
    publish_s = time.perf_counter() - t0
    rows = [None] * dist.world
    import torch.distributed as tdist

    if dist.enabled:
        tdist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    if dist.is_main:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(publisher.store.folder(1))   # the folder loads
        print(json.dumps({"ranks": rows, "publish_s": publish_s,
                          "params": sum(p.numel() for p in loaded.parameters())}), flush=True)
    dist.close()


def run_strategy(strategy: str, args, model: Path, base: Path) -> dict:
    out = base / strategy
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           str(Path(__file__).resolve()), "--role", "worker", "--strategy", strategy, "--model", str(model),
           "--out", str(out), "--steps", str(args.steps), "--seq", str(args.seq)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log(f"{strategy}: torchrun --nproc_per_node {args.ranks} ...")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{strategy} workers failed ({p.returncode}):\n{p.stderr[-4000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


def run_launcher(kind: str, run: Path) -> dict:
    """One `asyncgrpo run` with launcher `kind`; seconds to its start, steps, stop and exit."""
    cmd = [sys.executable, "-m", "pipeline", "run", str(REPO / "configs" / "default.toml"), "--run", str(run), "--force",
           "--launcher", kind, "--set", "trainer.max_steps=3", "--set", "run.time_limit_s=none",
           "--set", "run.eval_size=20"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    lines: list[str] = []
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        lines.append(line)
        for key, prefix in (("started", "started the trainer"), ("stopping", "stopping (")):
            if key not in marks and line.startswith(prefix):
                marks[key] = time.perf_counter() - t0
    code = p.wait()
    wall = time.perf_counter() - t0
    if code != 0 or len(marks) < 2:
        raise SystemExit(f"asyncgrpo run --launcher {kind} failed ({code}):\n{''.join(lines[-40:])}")
    return {"startup_s": marks["started"], "run_s": marks["stopping"] - marks["started"],
            "shutdown_s": wall - marks["stopping"], "wall_s": wall}


def compare_launchers(n: int, base: Path) -> dict:
    """n runs of each launcher, alternating; medians and ray - local."""
    import statistics

    got: dict[str, list[dict]] = {"local": [], "ray": []}
    for i in range(n):
        for kind in ("local", "ray"):
            r = run_launcher(kind, base / f"launch-{kind}-{i}")
            log(f"launcher {kind} #{i + 1}: start-up {r['startup_s']:.1f} s, steps {r['run_s']:.1f} s, "
                f"shut-down {r['shutdown_s']:.1f} s, wall {r['wall_s']:.1f} s")
            got[kind].append(r)
    out: dict = {"launches": n}
    for key in ("startup_s", "run_s", "shutdown_s", "wall_s"):
        for kind in got:
            out[f"{kind}_{key}"] = round(statistics.median(r[key] for r in got[kind]), 2)
        out[f"ray_minus_local_{key}"] = round(out[f"ray_{key}"] - out[f"local_{key}"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--launches", type=int, default=3,
                    help="runs of each launcher for the start-up overhead (0 skips that part)")
    ap.add_argument("--no-memory", action="store_true", help="skip the DDP/FSDP memory part (launchers only)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        worker(args)
        return
    from workers.model import TinyModelSpec, init_model

    base = Path(tempfile.mkdtemp(prefix="scaleout-", dir=args.dir))
    try:
        spec = TinyModelSpec(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_attention_heads=12 if args.hidden % 12 == 0 else 8,
                             num_key_value_heads=12 if args.hidden % 12 == 0 else 8)
        out: dict = {"ranks": args.ranks, "steps": args.steps}
        res = {}
        if not args.no_memory:
            model = init_model(base / "model", seed=0, spec=spec)
            res = {s: run_strategy(s, args, model, base) for s in ("ddp", "fsdp")}
            out["params"] = res["fsdp"]["params"]
        for s, r in res.items():
            for key in ("params_mb", "grads_mb", "optimizer_mb", "train_state_mb", "peak_rss_mb", "step_s"):
                out[f"{s}_{key}"] = round(max(row[key] for row in r["ranks"]), 3)
            out[f"{s}_publish_s"] = round(r["publish_s"], 3)
        for key in ("params_mb", "grads_mb", "optimizer_mb", "train_state_mb", "peak_rss_mb", "publish_s") if res else ():
            out[f"fsdp_over_ddp_{key}"] = round(out[f"fsdp_{key}"] / out[f"ddp_{key}"], 3) if out[f"ddp_{key}"] else None
        if args.launches > 0:
            out.update(compare_launchers(args.launches, base))
        out["dir"] = str(base) if args.keep else None
        print(json.dumps(out))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
