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


def hub_snapshot(cache, repo_id: str, commit: str, *, kind: str = "model", main: bool = True):
    """An empty snapshot folder in the Hugging Face cache layout, ``<cache>/<kind>s--org--name/snapshots/<commit>``
    (with ``refs/main`` naming ``commit`` unless ``main`` is False), for tests that save a tiny checkpoint or
    dataset the real loaders then read offline."""
    from pathlib import Path

    repo = Path(cache) / f"{kind}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snap
