"""Shared fixtures: the smoke-preset task of a scenario and a small collated batch of it.

A test module names its scenario once, ``SCENARIO = "llm-text"``, and uses the ``smoke`` and ``batch``
fixtures; a scenario whose Debian asset is missing is skipped (failed under ``BENCH_REQUIRE_ASSETS=1``,
see tests/assets.py). A module that defines its own ``smoke`` / ``batch`` keeps it (pytest's override).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.assets import need

if os.environ.get("PYTEST_XDIST_WORKER"):  # pyproject's addopts run the suite in worker processes (pytest-xdist)
    import torch

    # one thread each, as the harness's own workers: on 2 cores two single-thread processes gave 1.9x one, while
    # two threads in one process under load were 3x slower than one (README: BENCH_THREADS)
    torch.set_num_threads(1)

# scenario -> (file that proves its smoke data is installed, how to install it)
SMOKE_ASSETS: dict[str, tuple[str, str]] = {
    "llm-text": ("/usr/share/games/fortunes/fortunes", "apt-get install fortunes fortunes-min"),
    "vlm-caption": (
        "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz",
        "apt-get install dataset-fashion-mnist",
    ),
}
BATCH = 6  # items in the ``batch`` fixture


def smoke_tasks(scenario: str) -> list:
    """Every task of ``scenario`` at the smoke preset (its asset checked first)."""
    from bench.registry import SCENARIOS

    if scenario in SMOKE_ASSETS:
        path, install = SMOKE_ASSETS[scenario]
        need(Path(path).is_file(), install)
    return list(SCENARIOS.get(scenario)("smoke"))


@pytest.fixture(scope="module")
def smoke(request: pytest.FixtureRequest):
    """The module's scenario (``SCENARIO``) at the smoke preset; its first task when it has several."""
    scenario = getattr(request.module, "SCENARIO", None)
    if not scenario:
        pytest.fail(f"{request.module.__name__} uses the 'smoke' fixture but sets no SCENARIO = '<name>'")
    return smoke_tasks(scenario)[0]


@pytest.fixture(scope="module")
def batch(smoke):
    """The first ``BATCH`` test items of the smoke task, collated."""
    return smoke.api.collate([smoke.test_data[i] for i in range(BATCH)])
