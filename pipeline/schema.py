"""Reading nested frozen dataclasses from plain dicts (TOML), and writing them back.

Generic over any dataclass tree: unknown keys, wrong types and values the
dataclass's own `__post_init__` rejects all become one `ConfigError` that names
the key path (`trainer.loss.epsilon`), the bad value and where it came from.
Field docstrings (the string literal under each field, as in CleanRL) are read
from the source, so `asyncgrpo config --explain` documents every field once.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
from functools import lru_cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from workers.checks import ConfigError


NONE = "none"  # TOML has no null: an optional field set to None is written as "none"


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or {NONE!r}" if len(args) < len(get_args(tp)) else inner
    if origin in (tuple, list):
        return f"a list of {_type_name(get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value, tp, key: str):
    """`value` as type `tp`, or ConfigError naming `key`. None stands for TOML's missing value."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if (value is None or value == NONE) and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        items = [_coerce(v, get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        return build(tp, value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and isinstance(value, bool) or tp is str and isinstance(value, str):
        return value
    if tp in (int, float) and isinstance(value, tp) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def build(cls, data: dict, prefix: str = ""):
    """An instance of dataclass `cls` from `data`; defaults fill what `data` omits."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            near = difflib.get_close_matches(k, names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {_join(prefix, k)!r}{hint}")
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
            # A partial table overrides the field's own default, not the nested class's defaults
            # (TrainerConfig.loss defaults to objective="decoupled"; PolicyLossConfig to "bypass").
            f = defaults[k]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            v = merge(to_dict(default), v)
        kwargs[k] = _coerce(v, hints[k], _join(prefix, k))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_rename(str(e), cls, prefix)) from None
    except (ValueError, TypeError) as e:  # classes that raise plain ValueError (PolicyLossConfig)
        raise ConfigError(_rename(str(e), cls, prefix)) from None


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _rename(msg: str, cls, prefix: str) -> str:
    """'TrainerConfig.lr must be ...' -> 'trainer.lr must be ...' (the key a user writes)."""
    head = f"{cls.__name__}."
    return _join(prefix, msg[len(head):]) if msg.startswith(head) else f"{prefix or cls.__name__}: {msg}"


def to_dict(obj) -> dict:
    """A dataclass tree as nested dicts; None becomes "none" (TOML has no null)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif v is None:
            out[f.name] = NONE
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def merge(base: dict, over: dict) -> dict:
    """`over` laid on `base`, table by table."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_path(data: dict, dotted: str, value) -> dict:
    """`data` with `a.b.c = value` laid on it."""
    keys = dotted.split(".")
    over: dict = {}
    cur = over
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return merge(data, over)


@lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (empty where there is none)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain(cls, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every leaf field of the dataclass tree `cls`."""
    rows = []
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(tp):
            rows.extend(explain(tp, key))
        else:
            rows.append((key, _type_name(tp), getattr(defaults, f.name), docs.get(f.name, "")))
    return rows


__all__ = ["ConfigError", "build", "explain", "field_docs", "merge", "set_path", "to_dict"]
