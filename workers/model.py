"""The embedded default model: a tiny Qwen2 causal LM with a character tokenizer.

Nothing can be downloaded at run time, so the default policy is built here
from a config: Qwen2 architecture, 4 layers, hidden 128, 4 heads, intermediate
512, tied embeddings, a vocabulary of single characters padded to 64 (about
1.06M parameters). `init_model` saves it as a normal HF model folder
(safetensors, config.json, tokenizer files) that `AutoModelForCausalLM`,
`AutoTokenizer` and vLLM load like any other; real users point
`model.path` at a local HF folder instead.

The tokenizer is a `tokenizers` WordLevel model over single characters: `<bos>`
is prepended to every encoded text, `<eos>` ends a completion, padding is on
the left (so a batch of prompts ends at the same column for generation). It
carries a small chat template (`CHAT_TEMPLATE`, saved as chat_template.jinja)
written in the vocabulary's own characters, so `task.chat_template = true`
works with it end to end: "<bos>u:12+34=/a:", or "<bos>s:be,brief/u:12+34=/a:" with a
system prompt.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Every character the built-in tasks and the reward format tags need. No whitespace:
# transformers 5's AutoTokenizer loads any qwen2-type folder as Qwen2Tokenizer, whose
# byte-level pre-tokenizer drops whitespace that our tokenizer would keep; without
# whitespace in the vocabulary both give the same ids for every text.
CHARACTERS = list("0123456789+-*=()<>/.,:#?!_") + list("abcdefghijklmnopqrstuvwxyz")
VOCAB_SIZE = 64  # padded, so embedding rows are a round number
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}/{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}")
"""The tiny tokenizer's chat template: after one <bos>, each message as "<role initial>:<content>/"
("s:", "u:", "a:"; an assistant message ends with <eos> instead), then "a:" to open the answer.
Only characters of CHARACTERS, so nothing becomes <unk>; one-letter roles, because every character
is a token and the prompt's length is the tiny model's compute."""


ONEDNN_ENV = "ASYNCGRPO_ONEDNN"
"""Environment switch: "off" disables torch's oneDNN kernels in every process that loads a model,
so a result can be checked under other floating-point kernels; "on" or unset leaves torch's default."""


class ModelError(Exception):
    """A model folder that is missing or unusable; the message names the path."""


def apply_torch_switches() -> None:
    """Apply the process-wide torch settings named by the environment (`ONEDNN_ENV`)."""
    import torch

    value = os.environ.get(ONEDNN_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ModelError(f"environment variable {ONEDNN_ENV}={os.environ[ONEDNN_ENV]!r}: use 'on' or 'off'")
    torch.backends.mkldnn.enabled = value == "on"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the embedded default model (Qwen2 architecture)."""

    num_hidden_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    """Longest prompt + completion, in characters (tokens)."""


def build_tokenizer():
    """The character tokenizer as a `PreTrainedTokenizerFast` (left padding, `<bos>` prepended,
    `CHAT_TEMPLATE` as its chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=TinyModelSpec.max_position_embeddings, chat_template=CHAT_TEMPLATE)


def tiny_config(tokenizer, spec: TinyModelSpec = TinyModelSpec()):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")


def init_model(folder: str | os.PathLike, *, seed: int = 0, spec: TinyModelSpec = TinyModelSpec(),
               force: bool = False) -> Path:
    """Build the tiny model with random weights (seeded) and save it as an HF folder.

    Written to `<folder>.tmp` and renamed, so a crash never leaves a half-written
    folder at `folder`. Returns `folder`. An existing folder is kept unless `force`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if folder.exists() and not force:
        check_model_folder(folder)
        return folder
    apply_torch_switches()
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, spec), dtype=torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _pin_tokenizer_class(tmp)
    (tmp / "asyncgrpo.json").write_text(json.dumps({"built_by": "asyncgrpo init-model", "seed": seed}))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def _pin_tokenizer_class(folder: Path) -> None:
    """Make AutoTokenizer load our tokenizer.json as it is.

    Without an explicit class, transformers 5 picks the tokenizer class from the
    model type (Qwen2Tokenizer), which replaces the character pre-tokenizer with
    a byte-level one and drops spaces.
    """
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2))


def check_model_folder(folder: str | os.PathLike) -> Path:
    """`folder` if it looks like an HF model folder, else a ModelError saying what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"model folder {str(folder)!r} does not exist; set model.path to a local "
                         "HF model folder (config.json, *.safetensors, tokenizer files), or leave it "
                         "unset to use the embedded tiny model")
    if not (folder / "config.json").is_file():
        raise ModelError(f"model folder {str(folder)!r} has no config.json; is it an HF model folder?")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelError(f"model folder {str(folder)!r} has no weights (*.safetensors)")
    return folder


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer, with left padding and a pad token (EOS if it has none)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = check_model_folder(folder)
    # Our own folders load exactly as built (see CHARACTERS); others through AutoTokenizer.
    cls = PreTrainedTokenizerFast if (folder / "asyncgrpo.json").is_file() else AutoTokenizer
    tok = cls.from_pretrained(str(folder))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(folder: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu"):
    """An `AutoModelForCausalLM` from `folder` in `dtype` ("float32" or "bfloat16") on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    apply_torch_switches()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(check_model_folder(folder)), dtype=torch_dtype)
    return model.to(device)
