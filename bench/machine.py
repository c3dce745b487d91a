"""A speed probe of this machine's CPU, recorded with every record (``provenance.machine``) so that cost estimates
learned from records made elsewhere (a restored snapshot, another machine sharing ``--out``) are scaled to this
one: a run's plan on a CPU half as fast should say twice the time.

The probe is a fixed small forward+backward (two convolutions and a linear layer, batch 8 at 32 px) on one torch
thread, timed in this thread's CPU time (``time.thread_time``: other processes holding the cores do not count),
the median of 5 repetitions; ~0.1-0.3 s once per process. It stands for the dense fp32 kernels training and
attacks spend their time in; it says nothing of a GPU, so estimates scale only between CPU records and CPU runs.
"""

from __future__ import annotations

import platform
import statistics
import time
from functools import lru_cache

PROBE_VERSION = 1  # bump when the workload changes: probes of different versions are not compared


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def probe_s() -> float:
    """CPU seconds of the fixed workload (median of 5 repetitions of 4 forward+backward passes), 1 torch thread."""
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(32, 32, 3, padding=1, stride=2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 16 * 16, 64),
            )
            x = torch.randn(8, 3, 32, 32)
        times = []
        for rep in range(6):
            t0 = time.thread_time()
            for _ in range(4):
                net.zero_grad(set_to_none=True)
                net(x).square().mean().backward()
            if rep:  # the first repetition warms the allocator and kernels
                times.append(time.thread_time() - t0)
        return float(statistics.median(times))
    finally:
        torch.set_num_threads(threads)


def cpu_isa() -> str:
    """The instruction set torch's CPU kernels dispatch to here (``torch.backends.cpu.get_cpu_capability``: AVX2,
    AVX512, ...). One CPU name can hide two of them (an AVX2 and an AVX512 "AMD EPYC" both seen here), and the
    kernels, hence a training run's floating-point result, follow the instruction set, not the name."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


@lru_cache(maxsize=1)
def cpu_here() -> dict:
    """This machine's CPU name and instruction set (the keys :func:`same_cpu` compares), without the probe."""
    return {"cpu": cpu_name(), "isa": cpu_isa()}


def machine_info() -> dict:
    """What ``provenance.machine`` holds: the CPU's name and kernel instruction set, the probe's CPU seconds and
    its version."""
    return {**cpu_here(), "probe_s": round(probe_s(), 6), "probe_version": PROBE_VERSION}


def same_cpu(record_machine: object, here: dict) -> bool:
    """Whether a record's ``provenance.machine`` names this CPU and instruction set (``here``: the keys of
    :func:`machine_info` for this machine): only then can retraining here be expected to repeat its weights.
    A record from before the instruction set was recorded (schema revision < 9) cannot tell: False."""
    return isinstance(record_machine, dict) and all(record_machine.get(k) == here[k] for k in ("cpu", "isa"))


def speed_factor(record_machine: object) -> float | None:
    """How many times longer work takes here than on the machine a record names (its CPU seconds scale by it);
    None when the record has no comparable probe (written before probes were recorded, or another version)."""
    if not isinstance(record_machine, dict) or record_machine.get("probe_version") != PROBE_VERSION:
        return None
    theirs = record_machine.get("probe_s")
    if not isinstance(theirs, (int, float)) or not theirs > 0:
        return None
    return probe_s() / float(theirs)
