"""Which device a run's workers place models on: ``--device auto|cpu|cuda|cuda:N``.

Resolved once in the parent (bad input: UsageError, exit 2) and handed to every worker explicitly
(``WorkerConfig.device`` -> the unit); code follows the model's device from there (tensors are created
with ``device=`` of the tensors they combine with, never a hard-coded "cpu").
"""
from __future__ import annotations

import re

CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(raw: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``; ``cuda[:N]`` checked against the devices."""
    from .registry import UsageError

    raw = raw.strip().lower()
    if raw == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", raw)
    if raw != "auto" and m is None:
        raise UsageError(f"unknown device {raw!r}. Valid choices: {', '.join(CHOICES)}")
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if raw == "auto":
        return "cuda" if n else "cpu"
    if not n:
        raise UsageError(f"--device {raw}: CUDA is not available on this machine (torch {torch.__version__}); "
                         f"use --device cpu or auto")
    index = int(m.group(1)) if m.group(1) is not None else 0
    if index >= n:
        raise UsageError(f"--device {raw}: only {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return raw
