"""Benchmark of rollout generation: prefix sharing against HF generate, and vLLM.

    python bench/generate.py [--prompts 8] [--prompt-len 256] [--group 8] [--new-tokens 32]
                             [--repeats 5] [--threads 2] [--no-vllm]

Progress goes to stderr; the last line on stdout is one JSON object.

What is measured, on the embedded tiny model (random weights, `init_model` into a
temp folder), `--threads` torch threads, temperature 1, no top-p / top-k:

- prefix_shared: `HFBackend.generate(prompts, n=G)`: each prompt prefilled once, its
  KV cache expanded to its G samples, behaviour log-probs included.
- fresh_buffers: prefix_shared as it was before commit 5aadc22, with the decode loop's
  per-row key/value buffers allocated afresh for each call (a new `SuffixPool`)
  rather than kept from the previous call; `kept_buffers_speedup_paired` is
  prefix_shared / fresh_buffers (median of the per-repetition ratios).
- naive: `model.generate(num_return_sequences=G, do_sample=True)` on the same
  left-padded prompts (G prefills per prompt), with the log-probs a generator needs
  (`output_scores`, log_softmax at each sampled token) so both produce the same thing.
- vllm (when vllm imports): `VllmBackend.generate(prompts, n=G)`, prefix caching on,
  eager mode; engine start-up not timed. Timed after the HF methods, since vLLM's
  idle worker processes would otherwise share the cores with them.

Each repetition draws new random prompts (`--prompt-len` tokens with <bos>), so no
method finds a previous repetition's prompts in a cache; within a repetition every
method gets the same prompts. The HF methods alternate their order (prefix_shared
first, then last). After
one untimed warm-up of each method, the median over `--repeats` of tokens / second,
tokens = completion tokens actually generated (up to and including <eos>; the random
model ends about 40% of rows early). `speedup` = prefix_shared / naive (of the
medians); `speedup_paired` = the median of the per-repetition ratios, which moves
less when the machine's load changes during the run.

`load_avg_1m` is the machine's load when the run ended. These machines are shared:
with more runnable processes than cores, two torch threads stall on each other at
every small matmul (a decode step is ~30 of them) and both methods slow down 4-10x,
prefix sharing the most since it is decode-bound; compare runs made under similar
load, or use `--threads 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_prompts(rng: random.Random, count: int, length: int) -> list[str]:
    from workers.model import CHARACTERS
    return ["".join(rng.choice(CHARACTERS) for _ in range(length - 1)) for _ in range(count)]  # + <bos>


def naive_generate(model, tokenizer, prompts: list[str], G: int, new_tokens: int):
    """HF generate with G copies of each prompt; returns completion tokens generated (with log-probs)."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, num_return_sequences=G, max_new_tokens=new_tokens,
                             temperature=1.0, top_k=None, top_p=1.0, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        completion = out.sequences[:, enc["input_ids"].shape[1]:]                  # (N*G, C)
        scores = torch.stack(out.scores, dim=1)                                     # (N*G, C, V)
        logprobs = scores.log_softmax(-1).gather(-1, completion[..., None])[..., 0]  # noqa: F841
    done = (completion == tokenizer.eos_token_id).int().cumsum(-1)
    kept = (done == 0) | ((done == 1) & (completion == tokenizer.eos_token_id))     # up to the first <eos>
    return int(kept.sum())


def timed(fn):
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it is installed")
    args = ap.parse_args()

    import torch

    from workers.backends import SamplingConfig
    from workers.backends.hf import HFBackend, SuffixPool
    from workers.model import init_model

    torch.set_num_threads(args.threads)
    N, G, C = args.prompts, args.group, args.new_tokens
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=C)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model(Path(tmp) / "tiny", seed=0)
        backend = HFBackend(folder, seed=0)
        model, tok = backend.model, backend.tokenizer

        def shared(prompts):
            return sum(len(r.token_ids) for g in backend.generate(prompts, n=G, sampling=sampling) for r in g)

        def fresh(prompts):
            backend._pool = SuffixPool()            # what each call did before buffers were kept
            return shared(prompts)

        methods = {"prefix_shared": shared, "fresh_buffers": fresh,
                   "naive": lambda p: naive_generate(model, tok, p, G, C)}
        warm = random_prompts(rng, N, args.prompt_len)
        assert len(backend.prompt_token_ids(warm)[0]) == args.prompt_len
        for fn in methods.values():
            fn(warm)
        rates: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(args.repeats):
            prompts = random_prompts(rng, N, args.prompt_len)
            order = list(methods) if rep % 2 == 0 else list(reversed(methods))
            for name in order:
                tokens, sec = timed(lambda: methods[name](prompts))
                rates[name].append(tokens / sec)
                log(f"rep {rep} {name:14s} {tokens:5d} tokens {sec:6.3f} s {tokens / sec:9.0f} tok/s")
        result = {name: statistics.median(r) for name, r in rates.items()}
        backend.close()

        vllm_rate, vllm_note = None, None
        from workers.backends.vllm import vllm_available
        why = "--no-vllm" if args.no_vllm else vllm_available()
        if why is None:
            from workers.backends.vllm import VllmBackend
            t0 = time.perf_counter()
            vb = VllmBackend(folder, seed=0)
            log(f"vllm engine started in {time.perf_counter() - t0:.1f} s")

            def vllm_run(prompts):
                return sum(len(r.token_ids) for g in vb.generate(prompts, n=G, sampling=sampling) for r in g)

            vllm_run(random_prompts(rng, N, args.prompt_len))
            runs = []
            for rep in range(args.repeats):
                tokens, sec = timed(lambda: vllm_run(random_prompts(rng, N, args.prompt_len)))
                runs.append(tokens / sec)
                log(f"rep {rep} {'vllm':14s} {tokens:5d} tokens {sec:6.3f} s {tokens / sec:9.0f} tok/s")
            vb.close()
            vllm_rate = statistics.median(runs)
        else:
            vllm_note = f"vllm not measured: {why}"
            log(vllm_note)

    out = {
        "prefix_shared_tok_per_s": round(result["prefix_shared"], 1),
        "naive_tok_per_s": round(result["naive"], 1),
        "speedup": round(result["prefix_shared"] / result["naive"], 3),
        "speedup_paired": round(statistics.median(a / b for a, b in zip(rates["prefix_shared"], rates["naive"])), 3),
        "fresh_buffers_tok_per_s": round(result["fresh_buffers"], 1),
        "kept_buffers_speedup_paired": round(statistics.median(
            a / b for a, b in zip(rates["prefix_shared"], rates["fresh_buffers"])), 3),
        "prompts": N, "prompt_len": args.prompt_len, "group": G, "new_tokens": C,
        "repeats": args.repeats, "threads": args.threads,
        "runs_tok_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "targets": {"speedup_ge_2": result["prefix_shared"] / result["naive"] >= 2.0},
    }
    if vllm_rate is not None:
        out["vllm_tok_per_s"] = round(vllm_rate, 1)
    else:
        out["vllm_note"] = vllm_note
    print(json.dumps(out))


if __name__ == "__main__":
    main()
