"""Progress bars (tqdm) that stay quiet when BENCH_QUIET=1, and the switch that keeps third-party
loading noise (weight-loading bars, deprecation warnings, transformers logging) out of the terminal."""
from __future__ import annotations

import logging
import os
import warnings
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def _disabled() -> bool:
    return os.environ.get("BENCH_QUIET") == "1"


def progress(it: Iterable[T], *, desc: str = "", total: int | None = None, leave: bool = True) -> Iterable[T]:
    return tqdm(it, desc=desc, total=total, leave=leave, disable=_disabled(), dynamic_ncols=True, mininterval=1.0)


def progress_bar(*, total: float, desc: str = "", unit: str = "it", weighted: bool = False) -> tqdm:
    """A manually updated bar (``.update(n)``). ``weighted``: ``total`` is estimated seconds of work and each
    unit advances it by its own estimate, so the ETA follows the expensive work, not the count of cells."""
    fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]" if weighted else None
    return tqdm(total=total, desc=desc, unit=unit, disable=_disabled(), dynamic_ncols=True, mininterval=1.0,
                bar_format=fmt)


NOISY_LOGGERS = ("transformers", "diffusers", "huggingface_hub", "timm", "peft", "accelerate", "torch.distributed")


def silence_third_party() -> None:
    """Hide other libraries' progress bars, info logging and deprecation warnings (``--verbose`` skips this).
    Environment variables cover libraries imported later (and child processes); loggers those already loaded."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
    for cat in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for mod, fn in (("transformers.utils.logging", "disable_progress_bar"),
                    ("diffusers.utils.logging", "disable_progress_bar")):
        import sys

        m = sys.modules.get(mod)
        if m is not None and hasattr(m, fn):
            getattr(m, fn)()
