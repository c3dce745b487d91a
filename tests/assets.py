"""Tests that need a Debian asset: skipped where it is missing, but failed under ``BENCH_REQUIRE_ASSETS=1``
(CI sets it: setup.sh installs every asset, so a missing one there is a broken setup, not a reason to skip)."""

from __future__ import annotations

import os

import pytest


def need(present: bool, install: str) -> None:
    """Skip (or, under BENCH_REQUIRE_ASSETS=1, fail) the calling test when an asset is missing."""
    if present:
        return
    if os.environ.get("BENCH_REQUIRE_ASSETS") == "1":
        pytest.fail(f"asset missing although BENCH_REQUIRE_ASSETS=1: {install}")
    pytest.skip(install)
