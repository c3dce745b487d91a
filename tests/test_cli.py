"""The real CLI: bad input exits 2 with the choices and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BENCH_QUIET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--scenario", "nope"], "unknown scenario 'nope'"),
        (["--defense", "flrsp,fedavgg"], "Did you mean 'fedavg'"),
        (["--attack", "nope"], "unknown attack 'nope'"),
        (["--preset", "huge"], "Valid choices: smoke, default, paper"),
        (["--defense", "flrsp:R"], "malformed spec"),
        (["--defense", "flrsp:R=abc"], "not a valid float"),
        (["--defense", "flrsp:Q=1"], "Valid parameters: R, form"),
        (["--seeds", "0"], "--seeds must be a positive integer"),
        (["--seeds", "100000000000000"], "at most 1000"),
        (["--defense", "dp_gaussian:eps=nan"], "eps=nan is not a number"),
        (["--defense", "/etc/passwd"], "is neither a registered name nor a Python file"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, needle):
    out = tmp_path / "out"

    res = bench("run", "--preset", "smoke", "--out", str(out), *args, cwd=tmp_path)

    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert not out.exists()


def test_leaderboard_without_records_exits_2(tmp_path):
    res = bench("leaderboard", "--out", str(tmp_path / "none"), cwd=tmp_path)
    assert res.returncode == 2 and "no records" in res.stderr


@pytest.mark.parametrize(
    "raw, seeds",
    [("3", [0, 1, 2]), ("1-2", [1, 2]), ("1-1", [1]), ("0,2", [0, 2]), ("2,", [2]), (" 4 ", [0, 1, 2, 3])],
)
def test_seeds_count_range_and_list(raw, seeds):
    from bench.params import seed_count

    assert seed_count(raw) == seeds
