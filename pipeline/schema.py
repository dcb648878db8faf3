"""Reading nested frozen dataclasses from plain dicts (TOML), and writing them back.

Generic over any dataclass tree: unknown keys, wrong types and values the
dataclass's own `__post_init__` rejects all become one `ConfigError` that names
the key path (`trainer.loss.epsilon`), the bad value and where it came from.
A field typed `tuple[Entry, ...]` with a dataclass `Entry` is a list of tables,
built entry by entry (errors name `reward.functions[1].name`); a list is one
value, which a file or `--set` replaces whole. Defaults come from one place,
`field_default`: a nested section's defaults are its parent field's default.
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

import tomli_w

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
        entry = get_args(tp)[0]
        if dataclasses.is_dataclass(entry):
            return "a list of tables (" + ", ".join(f.name for f in dataclasses.fields(entry)) + ")"
        return f"a list of {_type_name(entry)}"
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


def field_default(f: dataclasses.Field):
    """The value a field takes when omitted (its default, or a fresh default_factory()), or MISSING.

    The one source of defaults for `build` and `explain`: a nested section's defaults are its
    field's default in the parent (TrainerConfig.loss defaults to objective="decoupled"), not the
    nested class's own (PolicyLossConfig: "bypass")."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def build(cls, data: dict, prefix: str = ""):
    """An instance of dataclass `cls` from `data`; defaults fill what `data` omits."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            near = difflib.get_close_matches(k, fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key {_join(prefix, k)!r}{hint}")
    for k, f in fields.items():
        if k not in data and f.init and field_default(f) is dataclasses.MISSING:
            raise ConfigError(f"{_join(prefix, k)} is missing; it has no default and must be given "
                              f"({_type_name(hints[k])})")
    kwargs = {}
    for k, v in data.items():
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
            v = merge(to_dict(field_default(fields[k])), v)  # a partial table overrides the field's default
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
    """A dataclass tree as nested dicts (lists of them as lists); None becomes "none" (TOML has no null)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    if v is None:
        return NONE
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


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


def explain(cls, prefix: str = "", defaults=None) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every leaf field of the dataclass tree `cls`.

    Defaults are read from `defaults` (None: `cls()`), walking down its nested sections, so they
    are the values a run really gets. The fields of a list's entries follow the list, keyed
    `section.list[].field`, with their own default or MISSING where they must be given."""
    rows = []
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls() if defaults is None else defaults
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = _join(prefix, f.name)
        value = getattr(defaults, f.name) if defaults is not dataclasses.MISSING else field_default(f)
        if dataclasses.is_dataclass(tp):
            rows.extend(explain(tp, key, value))
            continue
        rows.append((key, _type_name(tp), value, docs.get(f.name, "")))
        entry = get_args(tp)[0] if get_origin(tp) in (tuple, list) else None
        if dataclasses.is_dataclass(entry):
            rows.extend(explain(entry, key + "[]", dataclasses.MISSING))
    return rows


def explain_toml(cls) -> str:
    """`explain(cls)` as a TOML document: `key = default    # type`, then the field's doc as a comment.

    Loading it gives `cls()` again (a test says so); entry fields of lists are comments only."""
    out = []
    for key, tp, default, doc in explain(cls):
        if "[]" in key:
            given = "required" if default is dataclasses.MISSING else f"default {toml_value(default)}"
            out.append(f"# {key}    ({tp}, {given}; one per entry)")
        else:
            out.append(f"{key} = {toml_value(default)}    # {tp}")
        out.append(f"    # {doc}\n")
    return "\n".join(out)


def toml_value(v) -> str:
    """`v` (a dataclass tree, list, None or scalar) as the right-hand side of a TOML `key = value`."""
    return tomli_w.dumps({"v": _plain(v)}).removeprefix("v = ").rstrip("\n")


__all__ = ["ConfigError", "build", "explain", "explain_toml", "field_default", "field_docs", "merge", "set_path",
           "to_dict", "toml_value"]
