"""What every rollout backend shares: the sampling settings, one rollout, the interface.

A backend turns N prompts into N groups of n sampled completions, and reports
for each sampled token its behaviour log-probability

    log mu(y_t) = log_softmax(logits_t / temperature)[y_t]

of the tempered but *untruncated* distribution: top-p and top-k change which
tokens can be drawn, not the number stored. The trainer scores pi_theta the
same way (`workers.grpo.token_logprobs`), so the ratio pi_theta / mu compares
like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from workers.checks import is_int, is_num, require


class BackendError(RuntimeError):
    """A backend that cannot start or cannot do what was asked; the message says why."""


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled."""

    temperature: float = 1.0
    """Logits are divided by this before softmax; > 0 (greedy is top_k = 1)."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the smallest set of tokens whose probability reaches
    top_p; 1.0 keeps every token."""
    top_k: int | None = None
    """Draw only from the k most likely tokens; None keeps every token."""
    max_new_tokens: int = 16
    """Longest completion, in tokens, counting the final <eos>."""

    def __post_init__(self) -> None:
        require(self, "temperature", is_num(self.temperature, 0, lo_open=True), "a number > 0")
        require(self, "top_p", is_num(self.top_p, 0, 1, lo_open=True), "a number in (0, 1]")
        require(self, "top_k", self.top_k is None or is_int(self.top_k, 1), "an integer >= 1 or None (off)")
        require(self, "max_new_tokens", is_int(self.max_new_tokens, 1), "an integer >= 1")

    @property
    def truncated(self) -> bool:
        """Whether top-p or top-k removes any token from the tempered distribution."""
        return self.top_p < 1.0 or self.top_k is not None


@dataclass
class Rollout:
    """One sampled completion of one prompt."""

    token_ids: list[int]
    """Completion tokens, without the prompt; ends with <eos> when finish_reason is "stop"."""
    text: str
    """The completion decoded without special tokens."""
    logprobs: list[float]
    """log_softmax(logits / temperature) at each sampled token, one per token id."""
    finish_reason: Literal["stop", "length"]
    """"stop": sampled <eos>; "length": reached max_new_tokens without it."""


@runtime_checkable
class Backend(Protocol):
    """A rollout backend: `hf` (transformers) or `vllm`."""

    def generate(self, prompts: list[str], n: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[list[Rollout]]:
        """N prompts -> N lists of n rollouts each. The same seed gives the same rollouts;
        seed None draws one from the backend's own generator (seeded at construction)."""
        ...

    def prompt_token_ids(self, prompts: list[str]) -> list[list[int]]:
        """The token ids each prompt is fed as (`workers.chat.encode_prompts` with the backend's chat
        format: the tokenizer's special tokens, or the chat template; no padding)."""
        ...

    def load_weights(self, folder: Path) -> None:
        """Replace the weights in place by those in the HF folder `folder` (same architecture)."""
        ...

    def close(self) -> None:
        """Release the model (and any worker processes)."""
        ...


def check_generate_args(prompts: list[str], n: int) -> None:
    """Reject what no backend can do, with the bad value in the message."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a list of strings, got {prompts!r:.200}")
    if not is_int(n, 1):
        raise ValueError(f"n (completions per prompt) must be an integer >= 1, got {n!r}")


def stop_token_ids(folder: Path, tokenizer) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's eos and the generation config's eos ids."""
    import json

    ids = {tokenizer.eos_token_id} - {None}
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    if not ids:
        raise BackendError(f"the model in {str(folder)!r} names no eos token (tokenizer or "
                           "generation_config.json); completions could not stop")
    return frozenset(int(i) for i in ids)


def check_lengths(ids: list[list[int]], max_new_tokens: int, max_length: int | None) -> None:
    """Every prompt is non-empty and fits the model together with max_new_tokens."""
    for i, row in enumerate(ids):
        if not row:
            raise BackendError(f"prompt {i} encodes to no tokens (an empty prompt, and the tokenizer "
                               "adds no <bos>)")
        if max_length is not None and len(row) + max_new_tokens > max_length:
            raise BackendError(f"prompt {i} has {len(row)} tokens; with max_new_tokens={max_new_tokens} "
                               f"that exceeds the model's maximum length {max_length}")


def finish(token_ids: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> Literal["stop", "length"]:
    """The finish reason of a completion that ends where the sampler stopped it."""
    if token_ids and token_ids[-1] in stop_ids:
        return "stop"
    assert len(token_ids) == max_new_tokens, (len(token_ids), max_new_tokens)
    return "length"
