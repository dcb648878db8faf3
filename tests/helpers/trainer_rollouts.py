"""Rollouts sampled from a model itself, for trainer tests and the trainer benchmark.

`sample_groups` runs a plain sampling loop (no KV cache, no padding: the G
samples of a prompt grow together), so each stored behaviour log-prob is
exactly log_softmax(logits / temperature) of the sampled token, as a generator
stores it. Rewards come from a function of the completion's token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from buffer import Completion, Group

DIGIT_IDS = tuple(range(4, 14))  # '0'..'9' in the embedded character tokenizer


def first_token_in(ids: Sequence[int], allowed=DIGIT_IDS) -> float:
    """Reward 1 when the completion starts with one of `allowed` (default: a digit), else 0."""
    return 1.0 if len(ids) and ids[0] in allowed else 0.0


@torch.no_grad()
def sample_completions(model, prompt_ids: list[int], n: int, *, max_new_tokens: int, temperature: float,
                       eos_id: int, generator: torch.Generator) -> list[tuple[list[int], list[float], str]]:
    """n completions of one prompt: (token ids incl. a final eos, behaviour log-probs, finish reason)."""
    seq = torch.tensor([prompt_ids] * n)                                  # (n, P)
    done = torch.zeros(n, dtype=torch.bool)
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    for _ in range(max_new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1].float()   # (n, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]      # (n,)
        for i in range(n):
            if not done[i]:
                ids[i].append(int(tok[i]))
                lps[i].append(float(logp[i, tok[i]]))
        done |= tok == eos_id
        if bool(done.all()):
            break
        seq = torch.cat([seq, tok[:, None]], dim=1)
    return [(ids[i], lps[i], "stop" if ids[i][-1] == eos_id else "length") for i in range(n)]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 100, (n,), generator=g).tolist()
    b = torch.randint(0, 100, (n,), generator=g).tolist()
    return [f"{x}+{y}=" for x, y in zip(a, b)]


def sample_groups(model, tokenizer, prompts: list[str], group_size: int, *, version: int = 0,
                  max_new_tokens: int = 4, temperature: float = 1.0, seed: int = 0,
                  reward: Callable[[Sequence[int]], float] = first_token_in) -> list[Group]:
    """One group of `group_size` sampled completions per prompt, stamped with `version`."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for k, text in enumerate(prompts):
        pids = tokenizer(text).input_ids
        comps = []
        for ids, lps, finish in sample_completions(model, pids, group_size, max_new_tokens=max_new_tokens,
                                                   temperature=temperature, eos_id=tokenizer.eos_token_id,
                                                   generator=gen):
            r = reward(ids)
            comps.append(Completion(text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                                    logprobs=lps, reward=r, finish_reason=finish,
                                    reward_components={"accuracy": r}, correct=bool(r)))
        groups.append(Group(prompt_id=f"p{k}", prompt=text, prompt_ids=pids, version=version, completions=comps,
                            task="test", temperature=temperature))
    return groups


def mean_reward(model, tokenizer, prompts: list[str], group_size: int, *, seed: int, **kw) -> float:
    groups = sample_groups(model, tokenizer, prompts, group_size, seed=seed, **kw)
    rewards = [c.reward for g in groups for c in g.completions]
    return sum(rewards) / len(rewards)
