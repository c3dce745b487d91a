"""Static task declarations: what ``bench list`` plans over without building a task (no data, no model).

A scenario module may define ``specs(preset) -> list[DeclaredTask] | None``: for each task its id, the
:class:`~bench.types.TaskSpec` (all that ``applies()`` reads) and the FL settings, pinned from the module's
preset tables; None where they depend on an asset that is not there or only a loaded model knows (the
caller then builds the tasks). tests/test_startup.py checks the declarations equal the built tasks'.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from .types import FLConfig, TaskSpec


@dataclass(frozen=True)
class DeclaredTask:
    """A task as planning sees it: ``id`` (``Task.id``), ``api`` (its TaskSpec fields) and ``fl``."""

    id: str
    api: TaskSpec
    fl: FLConfig


def fashion_mnist_installed() -> bool:
    """Whether the Debian Fashion-MNIST files are there (a stat, no read): the scenarios built on it
    declare their tasks only then (else building them reports the missing asset, or falls back)."""
    from .data import FASHION_MNIST_DIR, FASHION_MNIST_FILES

    return all((FASHION_MNIST_DIR / f).is_file() for f in FASHION_MNIST_FILES.values())


def declared(builder: Callable, preset: str) -> list[DeclaredTask] | None:
    """The declarations of the scenario module that registered ``builder``, or None (no ``specs`` there, or
    it declares nothing at this preset)."""
    specs = getattr(sys.modules.get(getattr(builder, "__module__", ""), None), "specs", None)
    return specs(preset) if callable(specs) else None
