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
import traceback
import typing
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, TypeVar

from .errors import UsageError  # noqa: F401  (re-exported: callers import it from here)

if TYPE_CHECKING:  # annotations only: importing the registry stays light
    from .types import Attack, Defense

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str | None = None, entry_point_group: str | None = None):
        self.kind = kind
        self.package = package
        self.entry_point_group = entry_point_group
        self._items: dict[str, T] = {}
        self._paths: dict[str, T] = {}  # resolved contributed path -> what it registered (imported once)
        self._loaded = False
        self._index: dict[str, str] | None = None  # key -> module that registers it, read without importing
        self._eps: dict[str, Any] | None = None  # key -> entry point (loaded on first get)

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
        """Import every module of the package and every entry point (``items()``, contributed paths)."""
        if self._loaded:
            return
        self._loaded = True
        for mod in sorted(set(self._modules().values())):
            importlib.import_module(mod)
        for name in list(self._entry_points()):
            self._load_entry_point(name)

    def _modules(self) -> dict[str, str]:
        """key -> module, from the package's file names (and a ``name="..."`` in its register call), so that
        listing names and getting one method imports nothing else (start-up time)."""
        if self._index is None:
            self._index = {}
            if self.package:
                spec = importlib.util.find_spec(self.package)
                if spec is None:
                    raise ModuleNotFoundError(f"no package {self.package!r}")
                for info in sorted(pkgutil.iter_modules(spec.submodule_search_locations or []), key=lambda i: i.name):
                    if not info.name.startswith("_"):
                        self._index[_declared_key(info, self.package)] = f"{self.package}.{info.name}"
        return self._index

    def _entry_points(self) -> dict[str, Any]:
        if self._eps is None:
            self._eps = (
                {ep.name: ep for ep in metadata.entry_points(group=self.entry_point_group)}
                if self.entry_point_group
                else {}
            )
        return self._eps

    def _load_entry_point(self, key: str) -> None:
        obj = self._entry_points()[key].load()
        if obj not in self._items.values():
            self.register(obj, name=key)

    def names(self) -> list[str]:
        """Every registered key, without importing the methods."""
        return sorted(set(self._items) | set(self._modules()) | set(self._entry_points()))

    def installed_names(self) -> list[str]:
        """The keys of the installed code (the package's modules and entry points), without those registered at run
        time (a contributed file given by path, a test's toy): what a leaderboard's coverage is planned over."""
        return sorted(set(self._modules()) | set(self._entry_points()))

    def get(self, key: str) -> T:
        if key.endswith(".py") or "/" in key:
            self.load()  # a contributed file must not collide with any built-in name
            return self.load_path(key)
        if key not in self._items:
            if key in self._modules():
                importlib.import_module(self._modules()[key])
            elif key in self._entry_points():
                self._load_entry_point(key)
            if key not in self._items:  # a module registering under another key than the index guessed
                self.load()
        if key not in self._items:
            raise UsageError(unknown_message(self.kind, key, self.names()))
        return self._items[key]

    def load_path(self, path: str) -> T:
        """Import a contributed file and return the one object of this kind it registers.

        Every way the file can be wrong (not a ``.py`` file, does not import, registers a name that is
        taken, registers nothing or several) is a UsageError; a file given twice is imported once.
        """
        p = Path(path)
        if p.suffix != ".py":
            raise UsageError(
                f"{self.kind} {path!r} is neither a registered name nor a Python file (.py). "
                f"Valid choices: {', '.join(self.names())}, or a path to a .py file"
            )
        try:
            is_file, key = p.is_file(), str(p.resolve())
        except (OSError, ValueError) as e:  # a name too long, a NUL byte, a symlink loop
            raise UsageError(f"{self.kind} file {path!r} cannot be read: {e}") from None
        if not is_file:
            raise UsageError(f"{self.kind} file {path!r} does not exist (or is not a file)")
        if key in self._paths and self._paths[key] in self._items.values():
            return self._paths[key]
        before = dict(self._items)
        modname = f"_bench_contrib_{p.stem}"
        spec = importlib.util.spec_from_file_location(modname, p)
        if spec is None or spec.loader is None:
            raise UsageError(f"{self.kind} file {path!r} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        prior = sys.modules.get(modname)  # a same-named file loaded before: kept if this one is rejected

        def undo() -> None:
            if prior is None:
                sys.modules.pop(modname, None)
            else:
                sys.modules[modname] = prior
            self._items.clear()
            self._items.update(before)

        sys.modules[modname] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - SyntaxError, ImportError, a colliding name, SystemExit...
            undo()
            if isinstance(e, KeyboardInterrupt):
                raise
            raise UsageError(f"{self.kind} file {path!r} does not import: {_describe_import_error(e, p)}") from None
        new = [k for k in self._items if k not in before]
        if len(new) != 1:
            undo()
            raise UsageError(f"{path!r} must register exactly one {self.kind}; it registered {new or 'none'}")
        self._paths[key] = self._items[new[0]]
        return self._items[new[0]]

    def items(self) -> list[tuple[str, T]]:
        self.load()
        return sorted(self._items.items())


def _declared_key(info: pkgutil.ModuleInfo, package: str) -> str:
    """The key a package module registers: ``register_x(name="...")`` in its source, else its file name."""
    import re

    try:
        # typeshed's finder protocols lack ``path``; pkgutil's FileFinder has it
        src = Path(info.module_finder.path, f"{info.name}.py").read_text()  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return info.name
    m = re.search(r"register_\w+\(\s*name\s*=\s*[\"']([^\"']+)[\"']", src)
    return m.group(1) if m else info.name


def _module_key(obj: Any) -> str:
    mod = getattr(obj, "__module__", "") or ""
    return mod.rsplit(".", 1)[-1].removeprefix("_bench_contrib_")


def _describe_import_error(e: BaseException, path: Path) -> str:
    """One line: the error and where in the contributed file it happened (no traceback)."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}) while importing"
    line = next(
        (
            fr.lineno
            for fr in reversed(traceback.extract_tb(e.__traceback__))
            if Path(fr.filename).resolve() == path.resolve()
        ),
        None,
    )
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return f"{type(e).__name__}: {msg}" + (f" (line {line})" if line else "")


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


def unknown_message(kind: str, key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {key!r}.{hint} Valid choices: {', '.join(choices)}"


DEFENSES: Registry[type[Defense]] = Registry("defense", "defenses", "bench.defenses")
ATTACKS: Registry[type[Attack]] = Registry("attack", "attacks", "bench.attacks")
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
        if len(errors) == 1 and type(None) in args:
            raise UsageError(f"{errors[0]} (or none)")
        raise UsageError(f"{where}: cannot read {raw!r} as {typ}")
    if origin is typing.Literal:
        for a in args:
            if str(a) == raw:
                return a
        raise UsageError(f"{where}: {raw!r} is not one of {', '.join(map(str, args))}")
    if origin is tuple:  # "0+10+20", "(0, 10, 20)" or a lone value for tuple[int, ...] fields
        inner = args[0] if args else str
        items = raw.strip().removeprefix("(").removesuffix(")").replace("+", ",").split(",")
        return tuple(parse_value(v.strip(), inner, where) for v in items if v.strip())
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


def build(cls: type, overrides: Mapping[str, Any], kind: str) -> Any:
    """Instantiate a method dataclass with overrides, checking names, types and declared ranges
    (:mod:`bench.params`); every field of the result, defaults included, is range-checked."""
    from .params import check_config, check_values

    fields = {f.name: f for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}
    name = getattr(cls, "name", "") or cls.__name__
    try:
        hints = typing.get_type_hints(cls) if fields else {}
    except Exception as e:  # noqa: BLE001 - a contributed annotation naming something undefined
        raise UsageError(f"{kind} {name!r}: the types of its fields cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(overrides, Mapping):
        raise UsageError(
            f"{kind} {name!r}: a configuration must be a mapping of parameter names to values, got {overrides!r}"
        )
    kwargs = {}
    for k, v in overrides.items():
        if k not in fields:
            choices = ", ".join(sorted(fields)) or "none"
            raise UsageError(f"{kind} {name!r} has no parameter {k!r}. Valid parameters: {choices}")
        kwargs[k] = parse_value(v, hints[k], f"{kind} {name}:{k}") if isinstance(v, str) and hints[k] is not str else v
    given = {k: v for k, v in overrides.items() if isinstance(v, str)}
    if fields:
        check_values(cls, kwargs, kind, given=given)
    try:
        obj = cls(**kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the method's own validation, or a contributed bug
        msg = str(e) if isinstance(e, (TypeError, ValueError)) else f"{type(e).__name__}: {e}"
        raise UsageError(f"{kind} {name!r}: {msg}") from None
    if fields:
        check_config(obj, kind, given=given)
    return obj


def grid_configs(cls: type, kind: str) -> list[Any]:
    """Every configuration of ``cls.grid``, built and validated (a bad grid entry is a UsageError, as
    ``bench check`` reports it), whichever of them a run then uses."""
    name = getattr(cls, "name", "") or cls.__name__
    grid: Any = getattr(cls, "grid", ({},))  # checked next
    if isinstance(grid, (str, bytes, Mapping)) or not isinstance(grid, (tuple, list)) or not grid:
        raise UsageError(f"{kind} {name!r}: grid must be a non-empty tuple of parameter mappings, got {grid!r}")
    out = []
    for g in grid:
        try:
            out.append(build(cls, g, kind))
        except UsageError as e:
            raise UsageError(f"{e} (in the grid of {kind} {name!r}: {g!r})") from None
    return out


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
        if k in params:
            raise UsageError(f"malformed spec {spec!r}: parameter {k!r} is given twice; give each parameter once")
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
    its default configuration only (the dataclass defaults, the paper's); params pin one config. The
    whole grid of every method named is validated either way. A configuration given twice (``fedavg,fedavg``,
    ``flrsp,flrsp:R=0.5``) is a UsageError: it would be computed and counted twice.
    """
    specs = registry.names() if arg.strip() == "all" else split_specs(arg, registry.names())
    if not specs:
        raise UsageError(f"no {registry.kind} given. Valid choices: all, {', '.join(registry.names())}")
    if "all" in specs:
        raise UsageError(f"'all' stands alone: give --{registry.kind} all, or a list of names, not both (got {arg!r})")
    out: list[Any] = []
    seen: dict[tuple, str] = {}
    for spec in specs:
        name, params = parse_spec(spec)
        cls = registry.get(name)
        grid = grid_configs(cls, registry.kind)
        if params:
            configs = [build(cls, params, registry.kind)]
        else:
            configs = grid if full_grid else [build(cls, {}, registry.kind)]
        for cfg in configs:
            key = _config_key(cfg)
            if key in seen:
                raise UsageError(
                    f"{registry.kind} {_config_label(cfg)} is given twice (by {seen[key]!r} and "
                    f"{spec!r}); give each {registry.kind} configuration once"
                )
            seen[key] = spec
            out.append(cfg)
    return out


def _params(obj: Any) -> list[tuple[str, Any]]:
    return (
        [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init]
        if dataclasses.is_dataclass(obj)
        else []
    )


def _config_key(obj: Any) -> tuple:
    return (type(obj), tuple((k, repr(v)) for k, v in _params(obj)))


def _config_label(obj: Any) -> str:
    name = getattr(obj, "name", "") or type(obj).__name__
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in _params(obj))})"


def unique_names(names: list[str], kind: str) -> list[str]:
    """``names`` unchanged, or a UsageError naming the first one given twice."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise UsageError(f"{kind} {n!r} is given twice; give each {kind} once")
        seen.add(n)
    return names
