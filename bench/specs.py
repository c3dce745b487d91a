"""Static task declarations: what ``bench list`` and a fully cached ``bench run`` plan over without building a
task (no model, no tokenizer, no rendered data).

A scenario module may define ``specs(preset) -> list[DeclaredTask] | None``: for each task its id, the
:class:`~bench.types.TaskSpec` (all that ``applies()`` reads), the FL settings and, where the scenario can
compute it cheaply, its configuration (the very mapping ``Task.config`` holds, so ``config_hash`` and with it
every cell id and training key equal the built task's); None where they depend on an asset that is not there or
only a loaded model knows (the caller then builds the tasks). tests/test_startup.py checks the declarations
equal the built tasks', configuration hashes included.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from .types import FLConfig, TaskSpec


class LazyConfig(Mapping):
    """A task configuration computed on first access (``bench list`` never reads it; planning a cached run
    hashes it), then kept."""

    def __init__(self, compute: Callable[[], Mapping[str, Any]]):
        self._compute = compute
        self._value: Mapping[str, Any] | None = None

    def _get(self) -> Mapping[str, Any]:
        if self._value is None:
            self._value = self._compute()
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


@dataclass(frozen=True)
class DeclaredTask:
    """A task as planning sees it: ``id`` (``Task.id``), ``api`` (its TaskSpec fields), ``fl`` and, when the
    scenario declares it, ``config`` (``Task.config``; None = only building the task gives it)."""

    id: str
    api: TaskSpec
    fl: FLConfig
    preset: str = ""  # filled in by :func:`declared`
    config: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def scenario(self) -> str:
        return self.id.split("/", 1)[0]

    def config_hash(self) -> str:
        from .task import config_hash

        if self.config is None:
            raise ValueError(f"{self.id} declares no configuration at preset {self.preset}; build the task")
        if "_hash" not in self.__dict__:  # once per declaration: planning asks for it for every cell
            self.__dict__["_hash"] = config_hash(self.id, self.preset, self.fl, self.config)
        return self.__dict__["_hash"]


def fashion_mnist_installed() -> bool:
    """Whether the Debian Fashion-MNIST files are there (a stat, no read): the scenarios built on it
    declare their tasks only then (else building them reports the missing asset, or falls back)."""
    from .data import FASHION_MNIST_DIR, FASHION_MNIST_FILES

    return all((FASHION_MNIST_DIR / f).is_file() for f in FASHION_MNIST_FILES.values())


def declared(builder: Callable, preset: str) -> list[DeclaredTask] | None:
    """The declarations of the scenario module that registered ``builder``, or None (no ``specs`` there, or
    it declares nothing at this preset)."""
    specs = getattr(sys.modules.get(getattr(builder, "__module__", ""), None), "specs", None)
    decl = specs(preset) if callable(specs) else None
    return None if decl is None else [replace(d, preset=preset) for d in decl]


def configured(decl: list[DeclaredTask] | None) -> bool:
    """Whether every declaration carries its configuration (so cell ids can be computed without building)."""
    return decl is not None and all(d.config is not None for d in decl)
