"""Progress bars (tqdm) that stay quiet when BENCH_QUIET=1 or output is not a terminal in tests."""
from __future__ import annotations

import os
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress(it: Iterable[T], *, desc: str = "", total: int | None = None, leave: bool = True) -> Iterable[T]:
    return tqdm(it, desc=desc, total=total, leave=leave, disable=os.environ.get("BENCH_QUIET") == "1",
                dynamic_ncols=True, mininterval=1.0)


def progress_bar(*, total: int, desc: str = "") -> tqdm:
    """A manually updated bar (``.update(1)``) for loops whose items are not an iterable."""
    return tqdm(total=total, desc=desc, disable=os.environ.get("BENCH_QUIET") == "1", dynamic_ncols=True,
                mininterval=1.0)
