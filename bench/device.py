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
        raise UsageError(
            f"--device {raw}: CUDA is not available on this machine (torch {torch.__version__}); "
            f"use --device cpu or auto"
        )
    assert m is not None  # raw is cuda[:N] here
    index = int(m.group(1)) if m.group(1) is not None else 0
    if index >= n:
        raise UsageError(f"--device {raw}: only {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return raw


def placements(device: str, jobs: int, n_cuda: int | None = None) -> list[str]:
    """The device of each of ``jobs`` worker slots: a bare ``cuda`` on a machine with several GPUs spreads the
    slots over them (slot i on ``cuda:{i mod n}``, so workers share the GPUs evenly); ``cpu`` and an explicit
    ``cuda:N`` are every slot's. ``n_cuda``: the GPU count (None: ask torch)."""
    if device != "cuda":
        return [device] * jobs
    if n_cuda is None:
        import torch

        n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i % n_cuda}" for i in range(jobs)] if n_cuda > 1 else [device] * jobs


def gpu_memory_mb(device: str) -> int | None:
    """Total memory (MiB) of the GPU ``device`` (``cuda`` = the current one); None for the CPU or without CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory // 2**20)


PRECISIONS = ("fp32", "bf16", "fp16")
# where --precision applies: the transformer and diffusion families (image-cls always runs in fp32)
AUTOCAST_FAMILIES = ("llm-text", "vlm-caption", "ldm-t2i")


def check_precision(raw: str, device: str) -> str:
    """``--precision``: one of PRECISIONS; fp16 only on CUDA (CPU autocast supports bf16 only)."""
    from .registry import UsageError

    p = raw.strip().lower()
    if p not in PRECISIONS:
        raise UsageError(f"unknown precision {raw!r}. Valid choices: {', '.join(PRECISIONS)}")
    if p == "fp16" and not device.startswith("cuda"):
        raise UsageError(
            f"--precision fp16 needs a CUDA device (this run's device is {device}); use bf16 or fp32 on the CPU"
        )
    return p


def with_precision(task, precision: str):
    """``task`` whose configuration names ``precision`` (so its training cache key and cell ids do), except
    at fp32: fp32 tasks, keys and records stay exactly what they were before the option existed."""
    if precision == "fp32":
        return task
    from dataclasses import replace

    return replace(task, config={**dict(task.config), "precision": precision})


def precision_of(task) -> str:
    return str(dict(task.config).get("precision", "fp32"))


def autocast(task, device: str):
    """``torch.autocast`` at the task's precision for the families it applies to; otherwise a no-op."""
    import contextlib

    import torch

    p = precision_of(task)
    if p == "fp32" or task.api.family not in AUTOCAST_FAMILIES:
        return contextlib.nullcontext()
    return torch.autocast(
        "cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16 if p == "bf16" else torch.float16
    )
