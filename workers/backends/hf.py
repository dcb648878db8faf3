"""The transformers rollout backend (the CPU default), with prefix sharing.

`model.generate(num_return_sequences=G)` copies each prompt G times and
prefills every copy. Here each prompt is prefilled once, its KV cache is
expanded along the batch dimension (`repeat_interleave`, prompt i's rows become
i*G .. i*G+G-1), and a decoding loop of our own samples the G continuations:

    prefill   (N, P)    -> cache (N, ...), last logits (N, V)
    expand    cache, logits, mask: N -> B = N*G rows
    decode    one token per live row per step; a row that samples <eos> leaves
              the batch (its cache rows are dropped), its output is padded

Prompts are left-padded; the attention mask hides the padding and position ids
count real tokens only, so a prompt gets the same logits alone or in a batch.

Behaviour log-probs are `log_softmax(logits / temperature)` at the sampled
token: the tempered, *untruncated* distribution, even when top-p / top-k
restrict which tokens can be drawn (the trainer's pi_theta is scored the same
way). Sampling draws from one `torch.Generator` seeded per call, so a seed
reproduces a call exactly (same prompts, same batch limits).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from workers.backends.base import (BackendError, Rollout, SamplingConfig, check_generate_args,
                                   check_lengths, finish, stop_token_ids)
from workers.checks import is_int
from workers.model import check_model_folder, load_model, load_tokenizer


def truncate_logits(z: torch.Tensor, top_p: float, top_k: int | None) -> torch.Tensor:
    """Tempered logits with the tokens outside top-k, then outside top-p, set to -inf.

    z: (B, V). top-k keeps the k largest (ties with the k-th are kept); top-p then
    keeps the smallest prefix of the sorted distribution whose mass reaches top_p
    (always at least the most likely token). Returns (B, V), a new tensor.
    """
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]                   # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)           # (B, V)
        p = sorted_z.softmax(dim=-1)
        drop_sorted = (p.cumsum(dim=-1) - p) >= top_p               # mass before it already >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(truncate(logits / T)), and its behaviour log-prob.

    logits: (B, V) any float dtype. Returns tokens (B,) int64 and logprobs (B,) float32,
    logprobs[b] = log_softmax(logits[b] / T)[tokens[b]] (untruncated).
    """
    z = logits.float() / sampling.temperature                       # (B, V)
    probs = truncate_logits(z, sampling.top_p, sampling.top_k).softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)   # (B,)
    logprobs = z.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


class HFBackend:
    """Rollouts from a transformers causal LM with each prompt's prefill shared by its n samples."""

    def __init__(self, model_folder: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0, max_sequences: int | None = None):
        """max_sequences: most sequences (prompts x n) decoded in one batch; None: all of a call."""
        if max_sequences is not None and not is_int(max_sequences, 1):
            raise ValueError(f"max_sequences must be an integer >= 1 or None (no limit), got {max_sequences!r}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.folder = check_model_folder(model_folder)
        self.device = torch.device(device)
        self.model = load_model(self.folder, dtype=dtype, device=device).eval()
        self.tokenizer = load_tokenizer(self.folder)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(self.folder, self.tokenizer)
        self._stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        self.max_sequences = max_sequences
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self._seeds = torch.Generator().manual_seed(seed)

    # -- interface ---------------------------------------------------------------------------------

    def prompt_token_ids(self, prompts: list[str]) -> list[list[int]]:
        if not prompts:
            return []
        return [list(ids) for ids in self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]]

    def generate(self, prompts: list[str], n: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[list[Rollout]]:
        check_generate_args(prompts, n)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        generator = torch.Generator(self.device).manual_seed(seed)
        ids = self.prompt_token_ids(prompts)
        check_lengths(ids, sampling.max_new_tokens, self.max_length)
        per_batch = len(ids) if self.max_sequences is None else max(self.max_sequences // n, 1)
        groups: list[list[Rollout]] = []
        for start in range(0, len(ids), max(per_batch, 1)):
            groups += self._generate_batch(ids[start:start + per_batch], n, sampling, generator)
        return groups

    def load_weights(self, folder: str | os.PathLike) -> None:
        """Copy the weights of `folder` (*.safetensors, same architecture) into the model in place."""
        from safetensors.torch import load_file

        folder = check_model_folder(folder)
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise BackendError(f"{str(folder)!r} has no *.safetensors files to load weights from")
        state = {}
        for f in files:
            state.update(load_file(str(f), device=str(self.device)))
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        try:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        except RuntimeError as e:
            raise BackendError(f"weights in {str(folder)!r} do not fit the loaded model "
                               f"({self.folder}): {e}") from None
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise BackendError(f"weights in {str(folder)!r} do not match the loaded model ({self.folder}): "
                               f"missing {missing[:5]}, unexpected {unexpected[:5]}")

    def close(self) -> None:
        self.model = None
        gc.collect()

    # -- decoding ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _generate_batch(self, ids: list[list[int]], n: int, sampling: SamplingConfig,
                        generator: torch.Generator) -> list[list[Rollout]]:
        N, P, T = len(ids), max(len(r) for r in ids), sampling.max_new_tokens
        B = N * n
        dev = self.device
        input_ids = torch.full((N, P), self.pad_id, dtype=torch.long)         # (N, P) left padded
        mask = torch.zeros((N, P), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, P - len(row):] = torch.tensor(row)
            mask[i, P - len(row):] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)                        # (N, P) real tokens count

        from transformers import DynamicCache
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)                                      # (N, ...) -> (B, ...)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)                # (B, V)
        mask = mask.repeat_interleave(n, dim=0)                               # (B, P)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1          # (B, 1)

        rows = torch.arange(B, device=dev)               # live batch row -> output row
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((B, T), dtype=torch.float32, device=dev)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)
        for t in range(T):
            tok, lp = sample_tokens(logits, sampling, generator)              # (b,), (b,)
            tokens[rows, t], logps[rows, t] = tok, lp
            lengths[rows] += 1
            if t == T - 1:
                break
            live = ~torch.isin(tok, self._stop)
            if not bool(live.all()):
                if not bool(live.any()):
                    break
                keep = live.nonzero().squeeze(-1)                             # finished rows leave
                rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)     # (b, P+t+1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]                                        # (b, V)
            next_pos = next_pos + 1
        return self._rollouts(tokens.cpu(), logps.cpu(), lengths.cpu(), N, n, T)

    def _rollouts(self, tokens: torch.Tensor, logps: torch.Tensor, lengths: torch.Tensor,
                  N: int, n: int, T: int) -> list[list[Rollout]]:
        seqs = [tokens[b, :lengths[b]].tolist() for b in range(N * n)]
        texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=True)
        out = [Rollout(token_ids=s, text=txt, logprobs=logps[b, :len(s)].tolist(),
                       finish_reason=finish(s, self.stop_ids, T))
               for b, (s, txt) in enumerate(zip(seqs, texts))]
        return [out[i * n:(i + 1) * n] for i in range(N)]
