"""A toy matrix run as its own process, for the kill -9 tests of tests/test_faults.py (not a test module).

Usage: ``python tests/fault_run.py OUT``. Same cells as :func:`matrix` run in-process.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def matrix():
    """(tasks, defenses, attacks, seeds): 11 cells of about a second each, membership and reconstruction."""
    from defenses.fedavg import FedAvg
    from defenses.fedsgd import FedSGD
    from defenses.flrsp import FLRSP
    from tests.toy import ToyLossMIA, ToyMeanRecon, toy_task

    return [toy_task()], [FedAvg(), FLRSP(R=0.8), FedSGD()], [ToyLossMIA(), ToyMeanRecon()], [0]


def sleeper(marker: str) -> None:
    """A unit that writes its process id to ``marker`` and then runs for an hour (tests/test_engine.py)."""
    import os
    import time

    Path(marker).write_text(str(os.getpid()))
    time.sleep(3600)


def worker_pid(unit) -> dict:
    """A trivial unit whose outcome names the worker process it ran in (tests/test_engine.py)."""
    import os

    return {"key": unit.key, "kind": unit.kind, "status": "ok", "reason": "", "pid": os.getpid()}


def unit_device(unit) -> dict:
    """A trivial unit whose outcome names the device it reached its worker with (tests/test_engine.py)."""
    return {"key": unit.key, "kind": unit.kind, "status": "ok", "reason": "", "device": unit.device}


def tqdm_then_sleep(_unit) -> None:
    """A unit that draws a (disabled) progress bar and then hangs (tests/test_engine.py: killed at its timeout)."""
    import time

    from bench.progress import progress

    for _ in progress(range(2)):
        pass
    time.sleep(3600)


def hanging_jobs_run(out: str, marks: str) -> None:
    """Four hanging training runs (then the toy's base-model cells) on two worker processes: two run, the rest wait."""
    import functools

    from bench.executors import LocalExecutor, WorkerConfig
    from bench.runner import run
    from tests.toy import MarkThenHang, ToyLossMIA, toy_task

    task = toy_task()
    task.source = functools.partial(toy_task)  # how a worker rebuilds it
    defenses = [MarkThenHang(marks=marks, tag=i) for i in range(4)]
    run([task], defenses, [ToyLossMIA()], [0], Path(out), executor=LocalExecutor(2, WorkerConfig(threads=1)))


def main(out: str) -> int:
    import torch

    from bench.runner import run

    torch.set_num_threads(1)
    tasks, defenses, attacks, seeds = matrix()
    summary = run(tasks, defenses, attacks, seeds, Path(out))
    print(summary.counts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
