"""The one way a grpo registry is filled: a decorator that refuses duplicate names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def registrar(table: dict[str, F], what: str) -> Callable[[str], Callable[[F], F]]:
    """`@register("name")` adds a function to `table`; a second "name" is a ValueError naming `what`."""
    def register(name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in table:
                raise ValueError(f"{what} {name!r} is registered twice")
            table[name] = fn
            return fn
        return add
    return register
