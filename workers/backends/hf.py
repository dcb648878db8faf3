"""The transformers rollout backend (the CPU default), with prefix sharing.

`model.generate(num_return_sequences=G)` copies each prompt G times, prefills
every copy, and then reads G copies of the prompt's keys and values at every
decoding step. Here each prompt is prefilled once, and its KV cache is shared
by its G samples for the whole decode:

    prefill   (N, P) prompts, left-padded     -> prompt KV (N, H, P, D), logits (N, V)
    decode    B = N*G rows, one token a step:
              attention = softmax over [prompt keys (shared by the G rows of a
              prompt, read once per prompt) | the row's own completion keys]

The decode attention (`PrefixSharedKV`, registered with transformers as the
"asyncgrpo_prefix_shared" attention function and used only inside this loop)
computes exactly softmax(q K^T * scale + mask) V over the concatenated keys; it
just never materialises G copies of the prompt. With a 256-token prompt and
G = 8 that is 8x less memory traffic per step than copying the cache
(`DynamicCache.batch_repeat_interleave`), which is kept as the fallback for
models with sliding-window or soft-capped attention. Rows that sample a stop
token leave the batch: the layers after them compute only the rows still
decoding (late in a soak on the built-in task, 60% of the rows have stopped
before a call's last forward; in reasoning tasks lengths vary far more), and
the shared-prefix attention scatters their queries back into the (prompt,
sample) layout. Outputs of finished rows are padded. The loop ends when every
row has stopped or max_new_tokens is reached.

The attention mask hides the left padding and position ids count real tokens
only, so a prompt gets the same logits alone or in a batch.

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
from workers.chat import ChatFormat, check_chat_template, encode_prompts
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


ATTENTION_NAME = "asyncgrpo_prefix_shared"
PROMPT_IDS_CACHE = 65_536
"""Prompt texts whose token ids a backend keeps (all of them are dropped when it is full). A task's
prompts recur (the built-in one has 6,000), and the generator asks for each batch's ids twice (to
generate and to store them): tokenizing 32 prompts twice a batch took 2.7% of a generator's samples
late in a soak (py-spy)."""


class PrefixSharedKV:
    """Keys and values for decoding n samples of each of N prompts; a transformers cache stand-in.

    prefix: the prompts' (N, Hkv, P, D) keys/values per layer, stored once; prefix_mask (N, P)
    (1 = real token). Each of the B = N*n rows (prompt i owns rows i*n .. i*n+n-1) appends its
    own keys/values to a preallocated (B, Hkv, T, D) buffer, taken from `pool` (which keeps it for
    the next call) or allocated for this call alone. `update` (called by each attention
    layer) stores the step's key/value and returns a handle that `prefix_shared_attention` reads;
    `advance()` after each forward moves to the next position. `keep(mask)` drops finished rows:
    the following forwards carry only the rows in `self.rows` (indices into the B rows), whose
    buffers stay where they are.
    """

    def __init__(self, prefix_cache, prefix_mask: torch.Tensor, n: int, max_new_tokens: int,
                 pool: "SuffixPool | None" = None):
        self.prefix = [(layer.keys, layer.values) for layer in prefix_cache.layers]
        N, Hkv, P, D = self.prefix[0][0].shape
        k = self.prefix[0][0]
        self.n, self.length = n, 0
        self.prefix_bias = torch.zeros(N, 1, 1, P, dtype=torch.float32, device=k.device)   # (N, 1, 1, P)
        self.prefix_bias.masked_fill_(prefix_mask[:, None, None, :] == 0, float("-inf"))
        shape = (N * n, Hkv, max_new_tokens, D)
        self.suffix = (pool or SuffixPool()).take(shape, len(self.prefix), k)   # [(keys, values)] per layer
        self.rows: torch.Tensor | None = None      # the rows a forward carries (indices into B); None: all

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value: (B', Hkv, 1, D), the step's new entries of the rows carried, for layer `layer_idx`."""
        sk, sv = self.suffix[layer_idx]
        if self.rows is None:
            sk[:, :, self.length] = key[:, :, 0]
            sv[:, :, self.length] = value[:, :, 0]
        else:
            sk[self.rows, :, self.length] = key[:, :, 0]
            sv[self.rows, :, self.length] = value[:, :, 0]
        return (self, layer_idx), None

    def advance(self) -> None:
        self.length += 1

    def keep(self, mask: torch.Tensor) -> None:
        """Carry only the rows of the last forward where `mask` (B',) bool is True from now on."""
        rows = torch.arange(self.suffix[0][0].shape[0], device=mask.device) if self.rows is None else self.rows
        self.rows = rows[mask]

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """softmax([q Kp^T | q Ks^T] * scaling + mask) [Vp; Vs] for query (B', Hq, 1, D) -> (B', 1, Hq, D)."""
        kp, vp = self.prefix[layer_idx]                                    # (N, Hkv, P, D)
        sk, sv = self.suffix[layer_idx]
        ks, vs = sk[:, :, :self.length + 1], sv[:, :, :self.length + 1]    # (B, Hkv, L, D)
        rows = self.rows
        if rows is not None:                                               # the rows carried: B' of B
            ks, vs = ks[rows], vs[rows]                                    # (B', Hkv, L, D)
        Bc, Hq, _, D = query.shape
        N, Hkv, P, _ = kp.shape
        n, r = self.n, Hq // Hkv
        B = N * n
        # a prompt's n rows (and GQA's r query heads per kv head) share its keys: (N, Hkv, n*r, D);
        # finished rows, not carried, get zero queries here and their results are dropped
        qb = query if rows is None else query.new_zeros(B, Hq, 1, D).index_copy_(0, rows, query)
        qg = qb.view(N, n, Hkv, r, D).permute(0, 2, 1, 3, 4).reshape(N, Hkv, n * r, D)
        sp = torch.matmul(qg, kp.transpose(-1, -2)).float() * scaling + self.prefix_bias   # (N, Hkv, n*r, P)
        sp = sp.view(N, Hkv, n, r, P).permute(0, 2, 1, 3, 4).reshape(B, Hkv, r, P)
        if rows is not None:
            sp = sp[rows]                                                                    # (B', Hkv, r, P)
        ss = torch.matmul(query.view(Bc, Hkv, r, D), ks.transpose(-1, -2)).float() * scaling  # (B', Hkv, r, L)
        probs = torch.cat([sp, ss], dim=-1).softmax(dim=-1).to(query.dtype)                  # (B', Hkv, r, P+L)
        pp = probs[..., :P]
        if rows is not None:
            pp = pp.new_zeros(B, Hkv, r, P).index_copy_(0, rows, pp)
        pp = pp.reshape(N, n, Hkv, r, P).permute(0, 2, 1, 3, 4).reshape(N, Hkv, n * r, P)
        out = torch.matmul(pp, vp).view(N, Hkv, n, r, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, r, D)
        if rows is not None:
            out = out[rows]                                                                  # (B', Hkv, r, D)
        out = out + torch.matmul(probs[..., P:], vs)                                         # (B', Hkv, r, D)
        return out.reshape(Bc, Hq, 1, D).transpose(1, 2)                                     # (B', 1, Hq, D)


class SuffixPool:
    """The decode loop's per-row key/value buffers, kept from one call to the next.

    Allocated afresh, they can cost more than the copies into them: when the allocator has
    handed blocks this large back to the OS, each call faults in new zeroed pages. In a loop
    of 32 prompts x 8 samples on weights from late in a 60-minute run (4-token completions,
    one thread), calls took 60-67 ms against 73-79 ms; in that run's generator daemon, and in
    bench/generate.py, the two did not differ (it depends on the allocator's state; README,
    "Days, not minutes"). The buffers grow to the most rows (B) and positions (T) a call has
    asked for, and a call uses their first B rows and T positions; memory between calls is
    what the largest call held during its decode. One layer's keys/values: (B, Hkv, T, D).
    """

    def __init__(self):
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, shape: tuple[int, int, int, int], layers: int,
             like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`layers` (keys, values) pairs of `shape`, with `like`'s dtype and device (contents undefined)."""
        B, Hkv, T, D = shape
        have = self._buffers[0][0] if self._buffers else None
        fits = (have is not None and len(self._buffers) == layers
                and (have.shape[1], have.shape[3], have.dtype, have.device) == (Hkv, D, like.dtype, like.device))
        if not fits or have.shape[0] < B or have.shape[2] < T:
            if fits:
                B, T = max(B, have.shape[0]), max(T, have.shape[2])    # grow, never shrink
            self._buffers = []                                         # free the old ones first
            self._buffers = [(like.new_empty(B, Hkv, T, D), like.new_empty(B, Hkv, T, D)) for _ in range(layers)]
        return [(k[:shape[0], :, :shape[2]], v[:shape[0], :, :shape[2]]) for k, v in self._buffers]


def prefix_shared_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function for decoding through a `PrefixSharedKV`."""
    cache, layer_idx = key
    return cache.attend(layer_idx, query, scaling if scaling is not None else query.shape[-1] ** -0.5), None


def supports_prefix_sharing(config) -> bool:
    """Whether `prefix_shared_attention` computes this model's attention exactly (full causal,
    no soft-capping, no sliding window)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (all(t == "full_attention" for t in layer_types)
            and getattr(config, "attn_logit_softcapping", None) is None
            and not getattr(config, "use_sliding_window", False))


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, prefix_shared_attention)


class HFBackend:
    """Rollouts from a transformers causal LM with each prompt's prefill shared by its n samples."""

    def __init__(self, model_folder: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0, max_sequences: int | None = None, chat: ChatFormat | None = None):
        """max_sequences: most sequences (prompts x n) decoded in one batch; None: all of a call.
        chat: feed prompts through the tokenizer's chat template (`workers.chat`); None: plain text."""
        if max_sequences is not None and not is_int(max_sequences, 1):
            raise ValueError(f"max_sequences must be an integer >= 1 or None (no limit), got {max_sequences!r}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.folder = check_model_folder(model_folder)
        self.device = torch.device(device)
        self.model = load_model(self.folder, dtype=dtype, device=device).eval()
        self.tokenizer = load_tokenizer(self.folder)
        self.chat = chat
        check_chat_template(self.tokenizer, chat, self.folder)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(self.folder, self.tokenizer)
        self._stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        self.max_sequences = max_sequences
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self._seeds = torch.Generator().manual_seed(seed)
        self.prefix_sharing = supports_prefix_sharing(self.model.config)
        self._pool = SuffixPool()
        self._prompt_ids: dict[str, list[int]] = {}     # text -> token ids (PROMPT_IDS_CACHE)
        if self.prefix_sharing:
            _register_attention()

    # -- interface ---------------------------------------------------------------------------------

    def prompt_token_ids(self, prompts: list[str]) -> list[list[int]]:
        known = self._prompt_ids
        miss = [p for p in dict.fromkeys(prompts) if p not in known]
        if miss:
            if len(known) + len(miss) > PROMPT_IDS_CACHE:
                known.clear()
            known.update(zip(miss, encode_prompts(self.tokenizer, miss, self.chat)))
        return [list(known[p]) for p in prompts]

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
        self._pool = SuffixPool()
        gc.collect()

    # -- decoding ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _generate_batch(self, ids: list[list[int]], n: int, sampling: SamplingConfig,
                        generator: torch.Generator) -> list[list[Rollout]]:
        N, P, T = len(ids), max(len(r) for r in ids), sampling.max_new_tokens
        B, dev = N * n, self.device
        input_ids = torch.full((N, P), self.pad_id, dtype=torch.long)         # (N, P) left padded
        mask = torch.zeros((N, P), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, P - len(row):] = torch.tensor(row)
            mask[i, P - len(row):] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)                        # (N, P) real tokens count

        from transformers import DynamicCache
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True,
                         logits_to_keep=1)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)                # (B, V)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1          # (B, 1)
        if self.prefix_sharing:
            cache = PrefixSharedKV(out.past_key_values, mask, n, T, self._pool)
            step_mask = {"full_attention": None, "sliding_attention": None}   # masks are in the cache
        else:
            cache = out.past_key_values
            cache.batch_repeat_interleave(n)                                  # (N, ...) -> (B, ...)
            step_mask = mask.repeat_interleave(n, dim=0)                      # (B, P), grows each step

        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((B, T), dtype=torch.float32, device=dev)
        rows = torch.arange(B, device=dev)             # the rows still decoding; logits, next_pos: theirs
        attn = self.model.config._attn_implementation
        try:
            if self.prefix_sharing:
                self.model.config._attn_implementation = ATTENTION_NAME
            for t in range(T):
                tok, lp = sample_tokens(logits, sampling, generator)          # (B',), (B',)
                tokens[rows, t] = tok
                logps[rows, t] = lp
                going = ~torch.isin(tok, self._stop)                          # (B',)
                if t == T - 1 or not bool(going.any()):
                    break
                if not bool(going.all()):                                     # finished rows leave the batch
                    rows, tok, next_pos = rows[going], tok[going], next_pos[going]
                    if self.prefix_sharing:
                        cache.keep(going)
                    else:
                        cache.batch_select_indices(going.nonzero().squeeze(-1))
                        step_mask = step_mask[going]
                if not self.prefix_sharing:
                    step_mask = torch.cat([step_mask, step_mask.new_ones(len(rows), 1)], dim=-1)
                out = self.model(input_ids=tok[:, None], attention_mask=step_mask, position_ids=next_pos,
                                 past_key_values=cache, use_cache=True)
                if self.prefix_sharing:
                    cache.advance()
                logits = out.logits[:, -1]                                    # (B', V)
                next_pos = next_pos + 1
        finally:
            self.model.config._attn_implementation = attn
        return self._rollouts(tokens.cpu(), logps.cpu(), N, n, T)

    def _rollouts(self, tokens: torch.Tensor, logps: torch.Tensor, N: int, n: int, T: int) -> list[list[Rollout]]:
        seqs = []
        for row in tokens.tolist():                                           # cut after the first stop token
            end = next((i + 1 for i, t in enumerate(row) if t in self.stop_ids), T)
            seqs.append(row[:end])
        texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=True)
        out = [Rollout(token_ids=s, text=txt, logprobs=logps[b, :len(s)].tolist(),
                       finish_reason=finish(s, self.stop_ids, T))
               for b, (s, txt) in enumerate(zip(seqs, texts))]
        return [out[i * n:(i + 1) * n] for i in range(N)]
