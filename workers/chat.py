"""Prompt text -> the token ids a model is fed: plain, or through the tokenizer's chat template.

Plain (the default): the text as the tokenizer encodes it with its special
tokens (the tiny model's `<bos>`). With `task.chat_template = true` each prompt
becomes the conversation

    [{"role": "system", "content": task.system_prompt}   (only when one is set)
     {"role": "user",   "content": prompt text}]

rendered by the tokenizer's own chat template with the generation prompt (the
opening of the assistant's turn) appended, exactly as
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` gives it:
the template writes BOS and any other special tokens itself, and the rendered
text is tokenized without adding more, so none is doubled.

This is the one place prompts become token ids: generation (both backends),
evaluation and the warm start's SFT call `encode_prompts`; the generator stores
the ids with each group (`prompt_ids`) and the trainer trains on those stored
ids, so all four see the same ids. The `prompt` column of the buffer keeps the
task's text, without the template.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.model import ModelError


@dataclass(frozen=True)
class ChatFormat:
    """Prompts go through the tokenizer's chat template (`task.chat_template = true`)."""

    system_prompt: str | None = None
    """The system message before every prompt (`task.system_prompt`); None: no system message."""


def chat_messages(text: str, chat: ChatFormat) -> list[dict[str, str]]:
    """The conversation that one prompt becomes: [system message,] user message."""
    system = [] if chat.system_prompt is None else [{"role": "system", "content": chat.system_prompt}]
    return system + [{"role": "user", "content": text}]


def check_chat_template(tokenizer, chat: ChatFormat | None, folder: str | None = None) -> None:
    """ModelError naming task.chat_template and the model folder when `chat` is set but the
    tokenizer has no chat template, or its template cannot render a prompt (e.g. one that refuses
    a system message)."""
    if chat is None:
        return
    where = _require_template(tokenizer, folder)
    try:
        tokenizer.apply_chat_template(chat_messages("1+1=", chat), add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2 errors, and templates that raise_exception() on what they do not support
        raise ModelError(f"task.chat_template = true, but the chat template of model folder {where!r} cannot "
                         f"render a prompt{' with task.system_prompt' if chat.system_prompt else ''}: "
                         f"{type(e).__name__}: {e}") from None


def _require_template(tokenizer, folder=None) -> str:
    """The tokenizer's folder; ModelError naming it when the tokenizer has no chat template."""
    where = str(folder if folder is not None else tokenizer.name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"task.chat_template = true, but the tokenizer in model folder {where!r} has no chat "
                         "template (no chat_template.jinja, no chat_template in tokenizer_config.json); use a "
                         "model folder whose tokenizer has one, or set task.chat_template = false")
    return where


def encode_prompts(tokenizer, texts: list[str], chat: ChatFormat | None = None) -> list[list[int]]:
    """The token ids each prompt text is fed as (no padding): `tokenizer(text)` with its special
    tokens, or with `chat` the ids of `tokenizer.apply_chat_template([system,] user, ...)`."""
    if not texts:
        return []
    if chat is None:
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    _require_template(tokenizer)
    out = tokenizer.apply_chat_template([chat_messages(t, chat) for t in texts], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return [list(ids) for ids in out["input_ids"]]
