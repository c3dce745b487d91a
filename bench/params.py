"""Declared valid ranges of the methods' hyper-parameters, checked whenever a configuration is built.

A range is declared once, beside the field: ``R: float = param(0.5, ge=0.0, lt=1.0)``. ``build`` (and so
``run``, ``list`` and ``check``) rejects a value outside it with a message naming the method, the field,
the range and the value given (a :class:`~bench.registry.UsageError`: exit 2, nothing written).

Fields without a declaration get the generic rule, so a contributed method is checked for free:

- ``float``: finite (no NaN, no +-inf); ``int``: 0 <= value <= 2**31 - 1 (counts, seeds and indices are
  never negative, and a larger integer is a typo that would exhaust memory); ``bool`` must be a bool.
- ``tuple[float, ...]`` / ``tuple[int, ...]``: the same rule for every element.
- ``X | None``: None, or a value checked as ``X``.

NaN is never valid. ``+inf`` is accepted only where declared (``allow_inf=True``, e.g. Rényi order inf).

A field added to a method after records of it exist is declared ``param(..., added=True)`` with the default
that reproduces the earlier behaviour: at that default it is left out of the resolved parameters
(``bench.types.params_of``), so earlier records, training caches and cell ids stay valid.

Also here: the check of what a defense reports (an epsilon must be None or finite and >= 0, else the
cell fails) and of the harness's own values (``--seeds`` bounded, ``--out`` a writable directory).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import UsageError

RANGE_KEY = "bench_range"
ADDED_KEY = "bench_added"  # a field added later: left out of the resolved parameters at its default
INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric value (or of every element of a tuple); None = unbounded on that side."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    allow_inf: bool = False

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None or self.le is not None and self.lt is not None:
            raise TypeError("give at most one lower bound (ge or gt) and one upper bound (le or lt)")

    def describe(self) -> str:
        lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return (">= " if lo[0] == "[" else "> ") + lo[1:]
        if hi:
            return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
        return ""

    def violation(self, v: float) -> str | None:
        """Why ``v`` is out of range, or None."""
        if math.isnan(v):
            return "not a number (NaN)"
        if math.isinf(v) and not (self.allow_inf and v > 0):
            return "not finite"
        if (
            (self.ge is not None and not v >= self.ge)
            or (self.gt is not None and not v > self.gt)
            or (self.le is not None and not v <= self.le)
            or (self.lt is not None and not v < self.lt)
        ):
            return "out of range"
        return None


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def param(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    allow_inf: bool = False,
    added: bool = False,
    **kwargs: Any,
) -> Any:
    """A dataclass field with a declared valid range (for a tuple field: of each element); ``added``: a field
    added after records existed, whose default reproduces the earlier behaviour (module doc)."""
    rng = Range(ge=ge, gt=gt, le=le, lt=lt, allow_inf=allow_inf)
    meta = {**kwargs.pop("metadata", {}), RANGE_KEY: rng, **({ADDED_KEY: True} if added else {})}
    return dataclasses.field(default=default, metadata=meta, **kwargs)


# ----------------------------------------------------------------------------------------------
# the checks


def _shape(typ: Any) -> tuple[Any, bool, bool]:
    """(scalar type, is a tuple, accepts None) of a field annotation."""
    optional = False
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        typ = rest[0] if len(rest) == 1 else typ
        origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is tuple:
        return (args[0] if args else Any), True, optional
    return typ, False, optional


def range_of(f: dataclasses.Field, typ: Any) -> Range | None:
    """The declared range of a numeric field, else the generic rule for its type (None: nothing numeric to
    check, e.g. a ``Literal`` declared with ``param`` only to be ``added``)."""
    scalar = _shape(typ)[0]
    if scalar is not int and scalar is not float:
        return None
    declared = f.metadata.get(RANGE_KEY) if f.metadata else None
    if declared is not None:
        return declared
    if scalar is int:
        return Range(ge=0, le=INT_MAX)
    if scalar is float:
        return Range()
    return None


def _type_error(scalar: Any, v: Any) -> str | None:
    if typing.get_origin(scalar) is typing.Literal:
        choices = typing.get_args(scalar)
        return None if v in choices else f"expected one of {', '.join(map(str, choices))}"
    if scalar is str:
        return None if isinstance(v, str) else f"expected a string, got {type(v).__name__}"
    if scalar is bool:
        return None if isinstance(v, bool) else f"expected true/false, got {type(v).__name__}"
    if scalar is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
        return None if ok else f"expected an integer, got {type(v).__name__}"
    if scalar is float:
        return (
            None
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            else f"expected a number, got {type(v).__name__}"
        )
    return None


def field_problem(f: dataclasses.Field, typ: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``f`` (annotation ``typ``), or None when it is valid.

    The answer reads after "<field>=<value> is ", e.g. "not finite; eps must be a finite number > 0".
    """
    scalar, is_tuple, optional = _shape(typ)
    if value is None:
        return None if optional else f"not allowed; {f.name} must be set (None is not valid)"
    if is_tuple and not isinstance(value, tuple):
        return f"of the wrong type: expected a tuple, got {type(value).__name__}"
    values = value if is_tuple else (value,)
    rng = range_of(f, typ)
    for v in values:
        bad = _type_error(scalar, v)
        if bad:
            return f"of the wrong type: {bad}"
        if rng is not None and scalar in (int, float) and not isinstance(v, bool):
            why = rng.violation(float(v)) if not (isinstance(v, int) and abs(v) > 2**1000) else "out of range"
            if why:
                kind = "an integer" if scalar is int else "a finite number" if not rng.allow_inf else "a number"
                where = f"every element of {f.name}" if is_tuple else f.name
                bounds = rng.describe()
                return f"{why}; {where} must be {kind}" + (f" {bounds}" if bounds else "")
    return None


def describe_field(f: dataclasses.Field, typ: Any) -> str:
    """The range of a field as printed by ``bench check`` (e.g. ``R in [0, 1)``)."""
    rng = range_of(f, typ)
    declared = bool(f.metadata and RANGE_KEY in f.metadata)
    bounds = (rng.describe() or "finite") if rng else "any"
    return f"{f.name} {bounds}{'' if declared or rng is None else ' (generic rule)'}"


def check_config(obj: Any, kind: str, *, given: Mapping[str, Any] | None = None) -> None:
    """Raise UsageError naming the first field of the dataclass instance ``obj`` whose value is invalid.

    ``given``: the raw command-line strings, quoted in the message when a field came from one.
    """

    cls = type(obj)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in hints:
            continue
        problem = field_problem(f, hints[f.name], getattr(obj, f.name))
        if problem:
            raise UsageError(bad_value_message(kind, cls, f.name, getattr(obj, f.name), problem, given))


def check_values(cls: type, values: Mapping[str, Any], kind: str, *, given: Mapping[str, Any] | None = None) -> None:
    """Like :func:`check_config` but for keyword values before the class is instantiated (so that a clear
    range message comes before the method's own ``__post_init__`` error)."""

    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k, v in values.items():
        if k in fields and k in hints:
            problem = field_problem(fields[k], hints[k], v)
            if problem:
                raise UsageError(bad_value_message(kind, cls, k, v, problem, given))


def bad_value_message(
    kind: str, cls: type, name: str, value: Any, problem: str, given: Mapping[str, Any] | None
) -> str:
    raw = (given or {}).get(name)
    shown = raw if isinstance(raw, str) else repr(value)
    if isinstance(raw, str) and isinstance(value, float) and not math.isfinite(value) and raw != str(value):
        shown += f" (read as {value!r})"
    method = getattr(cls, "name", "") or cls.__name__
    return f"{kind} {method!r}: {name}={shown} is {problem}"


# ----------------------------------------------------------------------------------------------
# what a defense reports


PRIVACY_EPSILONS = ("epsilon", "epsilon_composed", "epsilon_composed_no_amplification")


def valid_epsilon(v: Any) -> bool:
    """None (no formal guarantee) or a finite number >= 0."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)


def check_privacy(privacy: Mapping[str, Any], defense: str) -> None:
    """Raise ValueError if a defense's epsilon is not None or a finite number >= 0 (NaN, negative, inf, a
    string...): the harness then records the cell failed with this reason instead of storing it."""
    for key in PRIVACY_EPSILONS:
        v = privacy.get(key)
        if not valid_epsilon(v):
            raise ValueError(
                f"defense {defense!r} reported {key}={v!r}: an epsilon must be None (no guarantee) "
                "or a finite number >= 0"
            )
    delta = privacy.get("delta")
    if delta is not None and not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"defense {defense!r} used delta={delta!r}: a DP delta must be in (0, 1)")


# ----------------------------------------------------------------------------------------------
# command-line values of the harness itself

MAX_SEEDS = 1000


def seed_count(raw: str) -> list[int]:
    """``--seeds``: ``N`` -> [0, ..., N-1] (1 <= N <= MAX_SEEDS); ``A-B`` -> [A, ..., B]; ``A,B,...`` -> those
    seeds (each in 0..MAX_SEEDS-1, no repeats): one seed of a run, or seeds split across machines. Else UsageError."""
    text = raw.strip()
    bad = UsageError(
        f"--seeds must be a positive integer (at most {MAX_SEEDS}; seeds 0..N-1), a range A-B or a list A,B,... of "
        f"distinct seeds in 0..{MAX_SEEDS - 1}, got {raw!r}"
    )
    if text.isdigit() and 1 <= int(text) <= MAX_SEEDS:
        return list(range(int(text)))
    span = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    parts = [p.strip() for p in text.split(",") if p.strip()] if "," in text else []
    if span:
        seeds = list(range(int(span[1]), int(span[2]) + 1))
    elif parts and all(p.isdigit() for p in parts):
        seeds = [int(p) for p in parts]
    else:
        raise bad
    if not seeds or len(set(seeds)) != len(seeds) or any(k >= MAX_SEEDS for k in seeds):
        raise bad
    return seeds


OUT_FOLDERS = ("records", "cache", "artifacts", "quarantine", "leaderboards")  # what a run keeps under --out


def writable_dir(raw: str, *, flag: str = "--out") -> Path:
    """``raw`` as an output directory that exists or can be created, and is writable; else UsageError.
    Checked before any work, so bad ``--out`` fails at once and writes nothing (a write probe in the
    directory, or in its nearest existing parent, is removed at once)."""

    if not raw.strip():
        raise UsageError(f"{flag} must name a directory; got an empty string")
    if "\0" in raw:
        raise UsageError(f"{flag} {raw!r} contains a NUL character, which no path may hold")
    p = Path(raw)
    try:
        if p.exists() and not p.is_dir():
            raise UsageError(f"{flag} {raw!r} is an existing file, not a directory")
        parent = p
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {raw!r} is under {str(parent)!r}, which is a file, not a directory")
        fd, probe = tempfile.mkstemp(prefix=".bench-write-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
        for sub in OUT_FOLDERS:  # a file where a run keeps a folder would fail it after the work
            if (p / sub).exists() and not (p / sub).is_dir():
                raise UsageError(
                    f"{flag} {raw!r} holds a file {sub!r} where a run keeps its {sub} folder; move it away"
                )
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"{flag} {raw!r} is not a writable directory ({why})") from None
    return p
