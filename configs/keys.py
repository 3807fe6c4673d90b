"""How a config key is declared, once: its type (the annotation), its default, its bound and its meaning.

    keep_last: int = key(2, "rolling tier: the newest committed checkpoints kept", AT_LEAST_1)
    async_mode: str = key("sync", "sync | async | async_process", choices=("sync", "async", "async_process"))

A section is a dataclass of such keys, declared by the package it configures (``<package>/config.py``,
torch-free). Hydra merges the YAML files and the overrides into the sections (a misspelled key or a
wrong type fails at compose time); ``problems(section, "checkpoint")`` then checks every value against
its declaration (finite, within its bound, one of its choices), and each section's ``check()`` adds what
involves several of its keys. Every message names the key, the value and the fix. Torch-free, and no
imports from this project: every layer may declare keys.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

MAX_SECONDS = 1e8  # about three years: longer waits overflow timedelta and Event.wait, and mean "never"


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the values and the fix."""


@dataclass(frozen=True)
class Bound:
    """low <= value (low < value when ``open_low``), value <= high (< when ``open_high``); ``also``: sentinel
    values allowed besides (-1: "any" / "fill"); ``why``: said in the message."""

    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False
    open_high: bool = False
    also: Tuple[int, ...] = ()
    why: str = ""

    def holds(self, value) -> bool:
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):  # an int never is (and may not fit a float)
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.open_high else '<='} {_num(self.high)}"
        else:
            text = "a finite number"
        return text + "".join(f" or {a}" for a in self.also) + (f" ({self.why})" if self.why else "")

    def because(self, why: str) -> "Bound":
        return dataclasses.replace(self, why=why)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


POSITIVE = Bound(0, open_low=True)
NON_NEGATIVE = Bound(0)
AT_LEAST_1 = Bound(1)
FRACTION = Bound(0, 1, open_high=True)  # [0, 1)
SECONDS = Bound(0, MAX_SECONDS, open_low=True)
SIZE = Bound(1, 2**31 - 1)  # a tensor dimension: positive and an int32 index


def key(default: Any, meaning: str, bound: Optional[Bound] = None, *, choices: Sequence = (), **extra) -> Any:
    """A dataclass field: ``default`` (a list or dict is copied per instance), what the key means, and what it
    may be: ``bound`` for a number (each value of a mapping or list of numbers), ``choices`` for a word (each
    item of a list of words). ``extra`` lands in the field's metadata: ``bounds`` (a mapping's key -> Bound)
    is checked too; the rest is the section's own."""
    meta = {"meaning": meaning, "bound": bound, "choices": tuple(choices), **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(factory: Callable[[], Any], meaning: str) -> Any:
    """A sub-section (a dataclass of keys) as a field of its parent."""
    return field(default_factory=factory, metadata={"meaning": meaning})


def _plain(tp):
    """Optional[X] -> X."""
    if typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


_HINTS: Dict[type, Dict[str, Any]] = {}


def hints(tp: type) -> Dict[str, Any]:
    """A section's key types, resolved once (typing resolves them anew on every call)."""
    if tp not in _HINTS:
        _HINTS[tp] = typing.get_type_hints(tp)
    return _HINTS[tp]


def declared(tp: type, prefix: str = "") -> Iterator[Tuple[str, Any, dataclasses.Field]]:
    """(dotted key, plain type, field) of every key a section type declares, sub-sections entered: ``[]``
    stands for a list's items (``recovery.faults[].step``), ``*`` for a mapping's keys (``recovery.timeouts.*``)."""
    for f in dataclasses.fields(tp):
        tp_f = _plain(hints(tp)[f.name])
        origin, args = typing.get_origin(tp_f), typing.get_args(tp_f)
        if is_dataclass(tp_f):
            yield from declared(tp_f, f"{prefix}{f.name}.")
        elif origin in (list, List) and args and is_dataclass(args[0]):
            yield from declared(args[0], f"{prefix}{f.name}[].")
        elif origin in (dict, Dict):
            yield f"{prefix}{f.name}.*", _plain(args[1]), f
        elif origin in (list, List):
            yield f"{prefix}{f.name}[]", _plain(args[0]), f
        else:
            yield f"{prefix}{f.name}", tp_f, f


def numeric_keys(tp: type) -> List[Tuple[str, type]]:
    """(dotted key, int or float) for every number a section type declares (its tests enumerate them)."""
    return [(k, t) for k, t, _ in declared(tp) if t in (int, float)]


def bound_of(tp: type, dotted: str) -> Optional[Bound]:
    """The bound declared for ``dotted`` in section type ``tp``: a key (``training.steps``), a list's items
    (``recovery.faults[].step``), any key of a mapping (``recovery.timeouts.*``) or a named one
    (``model.rope_scaling.factor``)."""
    for k, _, f in declared(tp):
        if k == dotted:
            return f.metadata.get("bound")
        named = f.metadata.get("bounds") or {}
        if k.endswith(".*") and dotted.startswith(k[:-1]) and dotted[len(k) - 1:] in named:
            return named[dotted[len(k) - 1:]]
        if not k.endswith(".*") and dotted.startswith(k + ".") and dotted[len(k) + 1:] in named:
            return named[dotted[len(k) + 1:]]
    return None


def _own(obj, prefix: str) -> Iterator[Tuple[str, Any, Optional[Bound], tuple]]:
    """(dotted key, value, its bound, its choices) of a section's own values (lists and mappings entered),
    and ("", sub-section, None, name) for each sub-section."""
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        bound, named, choices = f.metadata.get("bound"), f.metadata.get("bounds"), f.metadata.get("choices", ())
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else None
        if is_dataclass(value):
            yield "", value, None, name
        elif items is not None:
            for i, item in items:
                yield ("", item, None, f"{name}[{i}]") if is_dataclass(item) else (f"{name}[{i}]", item, bound, choices)
        elif isinstance(value, dict) and (bound is not None or named):
            for k, item in value.items():
                yield f"{name}.{k}", item, bound if bound is not None else named.get(k), ()
        else:
            yield name, value, bound, choices


def _own_problems(obj, prefix: str) -> Tuple[List[str], list]:
    """(the problems of a section's own values, its sub-sections as (section, name))."""
    out, subs = [], []
    for name, value, bound, choices in _own(obj, prefix + "." if prefix else ""):
        if not name:
            subs.append((value, choices))
        elif bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not bound.holds(value):
                what = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
                out.append(f"{name}={value} must be {what}{bound.describe()}")
        elif choices and value not in choices:
            out.append(f"{name}={value!r}: choose one of {list(choices)}")
    return out, subs


def in_bounds(obj) -> bool:
    """Every value of section ``obj`` (not its sub-sections) within its declaration."""
    return not _own_problems(obj, "")[0]


def problems(obj, prefix: str = "") -> List[str]:
    """Every value of section ``obj`` (sub-sections included) outside its declaration, one message each: a
    number outside its bound (NaN and the infinities never hold), a word not among its choices; and each
    section's own ``check()`` (what its keys cannot be together). A check that trips over a value already
    refused by its bound (a division by zero) adds nothing: the bound is the message. Keys are named
    ``prefix.key``."""
    out, subs = _own_problems(obj, prefix)
    check = getattr(obj, "check", None)
    if check is not None and not inspect.signature(check).parameters:
        try:
            out += check()
        except (ArithmeticError, TypeError, ValueError):
            if not out:
                raise
    for sub, name in subs:
        out += problems(sub, name)
    return out


def step_count_or_auto(value, key: str) -> int | str:
    """A key that takes a number of steps (0: off) or ``auto`` (checkpoint.interval and the like)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        steps = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r}: use a step count (0 turns it off) or auto")
    if steps < 0:
        raise ValueError(f"{key}={steps} must be >= 0 (0 turns it off) or auto")
    return steps


DIVISOR_SEARCH_LIMIT = 2**36  # trial division up to its square root: 2**18 steps, a few hundredths of a second


def divisors(n: int) -> Optional[List[int]]:
    """The divisors of ``n`` ascending (for the checks' suggestions), by trial division up to its square root;
    None when ``n`` is above DIVISOR_SEARCH_LIMIT or not a positive integer: a suggestion never costs a hang."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= DIVISOR_SEARCH_LIMIT:
        return None
    low, high = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            low.append(d)
            if d != n // d:
                high.append(n // d)
    return low + high[::-1]
