"""The vocabulary of the config checks: one ConfigError, and a list of problems that the checks fill.

Each package checks its own section of the config (``<package>/checks.py``), torch-free, into one
``Problems`` list; trainer/checks.py gathers them, and train.py prints the one block and exits
with code 2. Each message names the key, the value and the fix.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the values and the fix."""


class Problems(list):
    """Messages, one per problem found; the helpers add the common shapes of a bad value."""

    def choice(self, key: str, value, choices) -> None:
        if value not in choices:
            self.append(f"{key}={value!r}: choose one of {list(choices)}")

    def at_least(self, key: str, value, low, why: str = "") -> None:
        if value < low:
            self.append(f"{key}={value} must be >= {low}" + (f" ({why})" if why else ""))

    def positive(self, key: str, value) -> None:
        if not value > 0:
            self.append(f"{key}={value} must be > 0")

    def check(self, fn: Callable[[], T]) -> Optional[T]:
        """``fn()``, or None with its ValueError's message added (checks that raise)."""
        try:
            return fn()
        except ValueError as exc:
            self.append(str(exc))
            return None
