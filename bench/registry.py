"""Registries for scenarios, defenses and attacks.

One decorator per method; the registry key is the file name (``defenses/fedrand.py`` -> ``fedrand``).
Collisions raise; unknown names list the choices and a "did you mean". Contributed defenses come
from the ``bench.defenses`` entry-point group or from a ``.py`` path given on the command line.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import pkgutil
import sys
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class UsageError(ValueError):
    """Bad user input: the CLI prints it and exits with code 2."""


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str | None = None, entry_point_group: str | None = None):
        self.kind = kind
        self.package = package
        self.entry_point_group = entry_point_group
        self._items: dict[str, T] = {}
        self._loaded = False

    def register(self, obj: T | None = None, *, name: str | None = None) -> Any:
        """Decorator (``@DEFENSES.register``) or call; the key defaults to the defining file's name."""

        def _do(o: T) -> T:
            key = name or vars(o).get("name") or _module_key(o)
            if key in self._items and self._items[key] is not o:
                raise KeyError(f"{self.kind} {key!r} is already registered by {_where(self._items[key])}")
            if hasattr(o, "name") and isinstance(o, type):
                o.name = key  # type: ignore[attr-defined]
            self._items[key] = o
            return o

        return _do(obj) if obj is not None else _do

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if self.package:
            pkg = importlib.import_module(self.package)
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{self.package}.{info.name}")
        if self.entry_point_group:
            for ep in metadata.entry_points(group=self.entry_point_group):
                obj = ep.load()
                if obj not in self._items.values():
                    self.register(obj, name=ep.name)

    def names(self) -> list[str]:
        self.load()
        return sorted(self._items)

    def get(self, key: str) -> T:
        self.load()
        if key.endswith(".py") or "/" in key:
            return self.load_path(key)
        if key not in self._items:
            raise UsageError(unknown_message(self.kind, key, self.names()))
        return self._items[key]

    def load_path(self, path: str) -> T:
        """Import a contributed file and return the one object of this kind it registers."""
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{self.kind} file {path!r} does not exist")
        before = dict(self._items)
        modname = f"_bench_contrib_{p.stem}"
        spec = importlib.util.spec_from_file_location(modname, p)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
        new = [k for k in self._items if k not in before]
        if len(new) != 1:
            raise UsageError(f"{path!r} must register exactly one {self.kind}; it registered {new or 'none'}")
        return self._items[new[0]]

    def items(self) -> list[tuple[str, T]]:
        return [(k, self._items[k]) for k in self.names()]


def _module_key(obj: Any) -> str:
    mod = getattr(obj, "__module__", "") or ""
    return mod.rsplit(".", 1)[-1].removeprefix("_bench_contrib_")


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


def unknown_message(kind: str, key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {key!r}.{hint} Valid choices: {', '.join(choices)}"


DEFENSES: Registry[type] = Registry("defense", "defenses", "bench.defenses")
ATTACKS: Registry[type] = Registry("attack", "attacks", "bench.attacks")
SCENARIOS: Registry[Callable] = Registry("scenario", "bench.scenarios", "bench.scenarios")
register_defense = DEFENSES.register
register_attack = ATTACKS.register
register_scenario = SCENARIOS.register


# ----------------------------------------------------------------------------------------------
# "name:param=value:param=value" specs, type-checked against the dataclass fields


def parse_value(raw: str, typ: Any, where: str) -> Any:
    """Convert a command-line string to the field's declared type, or raise UsageError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(raw, a, where)
            except UsageError as e:
                errors.append(str(e))
        raise UsageError(f"{where}: cannot read {raw!r} as {typ}")
    if origin is typing.Literal:
        for a in args:
            if str(a) == raw:
                return a
        raise UsageError(f"{where}: {raw!r} is not one of {', '.join(map(str, args))}")
    if origin is tuple:  # "0+10+20" (or a lone value) for tuple[int, ...] fields
        inner = args[0] if args else str
        return tuple(parse_value(v, inner, where) for v in raw.replace("+", ",").split(",") if v)
    if typ is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"{where}: {raw!r} is not a boolean (true/false)")
    if typ in (int, float):
        try:
            return typ(raw) if typ is float else int(raw)
        except ValueError:
            raise UsageError(f"{where}: {raw!r} is not a valid {typ.__name__}") from None
    if typ is str:
        return raw
    raise UsageError(f"{where}: parameters of type {typ} cannot be set from the command line")


def build(cls: type, overrides: dict[str, Any], kind: str) -> Any:
    """Instantiate a method dataclass with overrides, checking names and types."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}
    hints = typing.get_type_hints(cls) if fields else {}
    kwargs = {}
    for k, v in overrides.items():
        if k not in fields:
            choices = ", ".join(sorted(fields)) or "none"
            raise UsageError(f"{kind} {cls.name!r} has no parameter {k!r}. Valid parameters: {choices}")
        kwargs[k] = parse_value(v, hints[k], f"{kind} {cls.name}:{k}") if isinstance(v, str) else v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{kind} {cls.name!r}: {e}") from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``flrsp:R=0.8:form=fedsgd`` -> ("flrsp", {"R": "0.8", "form": "fedsgd"})."""
    if spec.endswith(".py"):
        return spec, {}
    head, *rest = spec.split(":")
    if not head:
        raise UsageError(f"malformed spec {spec!r}: expected NAME or NAME:param=value[:param=value]")
    params = {}
    for part in rest:
        if "=" not in part or not part.split("=", 1)[0]:
            raise UsageError(f"malformed spec {spec!r}: {part!r} is not param=value")
        k, v = part.split("=", 1)
        params[k] = v
    return head, params


def split_specs(arg: str, names: list[str]) -> list[str]:
    """Split a comma list of specs; a numeric continuation (``ks=0,10``) stays with its spec."""
    import re

    out: list[str] = []
    for tok in (t.strip() for t in arg.split(",")):
        if not tok:
            continue
        head = tok.split(":", 1)[0]
        value_like = re.fullmatch(r"[-+0-9.eE]+|inf|nan", head) is not None
        if out and value_like and "=" in out[-1]:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def expand(registry: Registry, arg: str, *, full_grid: bool = True) -> list[Any]:
    """A CLI list (``all``, names, ``name:k=v``, paths) -> instantiated configurations.

    A bare name expands to the method's ``grid`` (its paper's settings), or with ``full_grid=False`` to
    its default configuration only (the dataclass defaults, the paper's); params pin one config.
    """
    specs = registry.names() if arg.strip() == "all" else split_specs(arg, registry.names())
    if not specs:
        raise UsageError(f"no {registry.kind} given. Valid choices: all, {', '.join(registry.names())}")
    out = []
    for spec in specs:
        name, params = parse_spec(spec)
        cls = registry.get(name)
        configs = [dict(g) for g in cls.grid] if not params else [params]
        if not params and not full_grid:
            configs = [{}]
        for cfg in configs:
            out.append(build(cls, cfg, registry.kind))
    return out
