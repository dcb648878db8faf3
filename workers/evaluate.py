"""Accuracy of a policy on a list of prompts: greedy by default, or sampled at a temperature.

Prompts are encoded as generation encodes them (`workers.chat.encode_prompts`:
plain, or through the chat template), batched with left padding and completed
by HF `generate`, which
stops each row at `<eos>` (or after `max_new_tokens`); each completion is
judged by a `Scorer` (its `correct`, i.e. the accuracy rule, not the reward).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from workers.chat import ChatFormat, check_chat_template, encode_prompts
from workers.rewards import Scorer
from workers.tasks import Prompt


@dataclass
class EvalResult:
    """Fraction correct overall and per level, over `n` prompts."""

    accuracy: float
    by_level: dict[str, float]
    n: int
    completions: list[str]


def complete(model, tokenizer, texts: list[str], *, max_new_tokens: int = 16, batch_size: int = 256,
             temperature: float | None = None, seed: int | None = None,
             chat: ChatFormat | None = None) -> list[str]:
    """One completion per text (special tokens dropped): greedy when `temperature` is None,
    else sampled from softmax(logits / temperature) with torch seeded by `seed`; `chat`: the texts
    go through the tokenizer's chat template."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for start in range(0, len(texts), batch_size):
            ids = encode_prompts(tokenizer, texts[start:start + batch_size], chat)
            batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")   # left padding, with its mask
            batch = {k: v.to(model.device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            sampling = ({"do_sample": False} if temperature is None else
                        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0})
            with torch.no_grad():
                ids = model.generate(**batch, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id, **sampling)  # (B, T_prompt + T_new)
            new = ids[:, batch["input_ids"].shape[1]:]
            out += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


def evaluate(model, tokenizer, prompts: list[Prompt], scorer: Scorer, *, max_new_tokens: int = 16,
             batch_size: int = 256, temperature: float | None = None, seed: int | None = None,
             chat: ChatFormat | None = None) -> EvalResult:
    """Accuracy overall and per level (greedy unless `temperature` is given); `chat`: prompts
    through the chat template (the task's `chat`)."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    completions = complete(model, tokenizer, [p.text for p in prompts], max_new_tokens=max_new_tokens,
                           batch_size=batch_size, temperature=temperature, seed=seed, chat=chat)
    hits: dict[str, list[bool]] = defaultdict(list)
    for p, c in zip(prompts, completions):
        hits[p.level].append(bool(scorer.score(p, c).correct))
    total = sum(sum(h) for h in hits.values())
    return EvalResult(total / len(prompts), {k: sum(h) / len(h) for k, h in sorted(hits.items())},
                      len(prompts), completions)


def greedy_accuracy(model, tokenizer, prompts: list[Prompt], scorer: Scorer, *, max_new_tokens: int = 16,
                    batch_size: int = 256, chat: ChatFormat | None = None) -> float:
    """Fraction of `prompts` whose greedy completion the scorer judges correct."""
    return evaluate(model, tokenizer, prompts, scorer, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, chat=chat).accuracy


def greedy_accuracy_folder(folder: str | os.PathLike, prompts: list[Prompt], scorer: Scorer, *,
                           max_new_tokens: int = 16, batch_size: int = 256, dtype: str = "float32",
                           device: str = "cpu", chat: ChatFormat | None = None) -> float:
    """`greedy_accuracy` of the model saved in an HF folder."""
    from workers.model import load_model, load_tokenizer

    tokenizer = load_tokenizer(folder)
    check_chat_template(tokenizer, chat, folder)
    model = load_model(folder, dtype=dtype, device=device)
    return greedy_accuracy(model, tokenizer, prompts, scorer, max_new_tokens=max_new_tokens,
                           batch_size=batch_size, chat=chat)
