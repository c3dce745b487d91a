"""Benchmark: two workers with and without the scheduler's signal affinity (bench.runplan.share_key).

    BENCH_THREADS=1 nice -n 10 python -m pytest -n 0 tests/bench_engine.py --benchmark-only -q -s

The smoke llm-text slice (FedAvg, seed 0; ``loss_mia`` with its proxy method and ``gradient_mia``, in every view
and on the base model) run by the real CLI with ``--jobs 2`` on one training run trained beforehand, with the
affinity off (every cell its own key: cells go to whichever worker is free, as before) and on, interleaved. Cells
that score the same candidates with the same model and attack (the base model's views, an attack's variants in
one view) then run one after another on one worker and read the signals from its cache instead of computing
them twice side by side. Printed: the work (the records' ``attack_wall_s``) of the base model's client-view cells,
whose signals its global-view cells computed; all cells' work; the run's wall time (noisy on a shared machine).
On smoke a cell's fixed cost (building the task and models in the worker) dominates, so the total moves little;
the default preset's signals are what costs (a vlm-caption base-model gradient_mia cell: ~46 min here).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import pytest

from bench import runplan
from bench.store import Store

ROUNDS = 2
ARGV = [
    "run",
    "--scenario",
    "llm-text",
    "--defense",
    "fedavg",
    "--attack",
    "loss_mia,gradient_mia",
    "--preset",
    "smoke",
    "--seeds",
    "0-0",
    "--jobs",
    "2",
    "--no-leaderboard",
]


def _work(out: Path) -> tuple[float, float]:
    """The cells' summed work, and that of the base model's client-view cells (the same signals as its global
    view's: what the affinity turns into cache hits)."""
    recs = [r for r in Store(out).records() if r.get("status") == "ok"]
    wall = {id(r): float((r.get("cost") or {}).get("attack_wall_s") or 0.0) for r in recs}
    again = [r for r in recs if r.get("defense") == "base" and r.get("view") == "client_model"]
    return sum(wall.values()), sum(wall[id(r)] for r in again)


@pytest.mark.benchmark(group="engine")
def test_signal_affinity_against_none(benchmark, tmp_path, monkeypatch):
    from bench.cli import main

    warm = tmp_path / "warm"
    assert main([*ARGV, "--out", str(warm)]) == 0  # trains once; every round reuses the training cache
    keyed = runplan.share_key
    got: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    n = iter(range(10**6))

    def one_round():
        for mode in ("off", "on"):
            monkeypatch.setattr(runplan, "share_key", keyed if mode == "on" else (lambda cell: ""))
            out = tmp_path / f"{mode}{next(n)}"
            shutil.copytree(warm / "cache", out / "cache")
            t = time.perf_counter()
            assert main([*ARGV, "--out", str(out)]) == 0
            got[mode].append((*_work(out), time.perf_counter() - t))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    med = {m: [statistics.median(x[i] for x in v) for i in range(3)] for m, v in got.items()}
    (w0, b0, t0), (w1, b1, t1) = med["off"], med["on"]
    benchmark.extra_info.update(work_off_s=w0, work_on_s=w1, repeats_off_s=b0, repeats_on_s=b1)
    print(
        f"\nthe base model's client-view cells (its global view's signals again): affinity off {b0:.1f} s, on "
        f"{b1:.1f} s ({b0 / max(b1, 1e-9):.1f}x less); all cells' work {w0:.1f} s against {w1:.1f} s "
        f"({w0 / max(w1, 1e-9):.2f}x); wall {t0:.1f} s against {t1:.1f} s"
    )
