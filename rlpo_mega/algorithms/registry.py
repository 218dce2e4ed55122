"""One small name -> function registry per extension point (losses, advantages, KL estimators, ...).

Adding an entry touches no other entry; an unknown name fails with the list of known ones.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError):
    def __str__(self):  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, *names: str):
        """Decorator: `@LOSSES.register("grpo", "ppo_clip")`. Re-registering a name is an error."""

        def wrap(fn: F) -> F:
            for name in names:
                if name in self._entries:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._entries[name] = fn
            return fn

        return wrap

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
