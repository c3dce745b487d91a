"""Benchmark: the leaderboard's bootstrap statistics on draws given as indices against the same on drawn values.

    BENCH_THREADS=1 nice -n 10 python -m pytest -n 0 tests/bench_bootstrap.py --benchmark-only -q -s

One sample of 250 members and 250 non-members (a default cell's global view) and 1,000 bootstrap draws (the
leaderboard's N_BOOT). Each round times, back to back on the same draws: AUROC and TPR at 5% FPR computed on
the drawn values (rank / sort every replicate row: the former path, ``bench.bootstrap.auroc_rows`` and
``tpr_at_fpr_rows``) and from the draws' counts over one sort (``bench.bootstrap.Drawn``), which the
leaderboard uses; both give the same numbers bit for bit (asserted here and in tests/test_report_stats.py).
Times are the calling thread's CPU time (``time.thread_time``), as in tests/bench_signals.py.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from bench.bootstrap import Drawn, hierarchical, member_stat
from bench.pigeonhole import Seed, pigeonhole
from tests.benchlib import one_thread  # noqa: F401 - the fixture

ROUNDS = 7
N, B = 250, 1000

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py


def _race(benchmark, make, check=None) -> dict[str, float]:
    """Median thread CPU time per side over ROUNDS rounds (the first dropped); ``make()`` gives one round's
    {side: function}, the sides run back to back on the same inputs; ``check(outputs)`` asserts on them."""
    times: dict[str, list[float]] = {}

    def one_round():
        out = {}
        for key, fn in make().items():
            t = time.thread_time()
            out[key] = fn()
            times.setdefault(key, []).append(time.thread_time() - t)
        if check is not None:
            check(out)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    benchmark.extra_info.update({f"{k}_s": v for k, v in med.items()})
    return med


@pytest.mark.benchmark(group="bootstrap")
@pytest.mark.parametrize("metric", ["auroc", "tpr@0.05fpr"])
def test_bench_statistic_on_draw_counts_over_drawn_values(benchmark, metric):
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(0.5, 1.0, N), rng.normal(0.0, 1.0, N)
    stat = member_stat(metric)
    assert stat is not None

    def make():
        i, m = rng.integers(0, N, (B, N)), rng.integers(0, N, (B, N))
        return {"values": lambda: stat(pos[i], neg[m]), "counts": lambda: stat.drawn(Drawn(pos, neg), i, m)}

    med = _race(benchmark, make, check=lambda out: np.testing.assert_array_equal(out["values"], out["counts"]))
    ratio = med["values"] / med["counts"]
    benchmark.extra_info.update(speedup=ratio)
    print(
        f"\n{metric} over {B} draws of {N} + {N}: drawn values {med['values'] * 1e3:.1f} ms, draw counts "
        f"{med['counts'] * 1e3:.1f} ms: {ratio:.1f}x"
    )


@pytest.mark.benchmark(group="bootstrap")
@pytest.mark.parametrize("metric", ["auroc", "tpr@0.05fpr"])
def test_bench_pigeonhole_over_the_nested_bootstrap(benchmark, metric):
    """3 seeds x the same 250 + 250 candidate ids (ldm-t2i's design): the leaderboard's bootstrap by id
    (``bench.pigeonhole``) against the nested one it replaced (seeds, then candidates within each seed)."""
    rng = np.random.default_rng(1)
    ids = [str(i) for i in range(2 * N)]
    scores = [np.concatenate([rng.normal(0.5, 1.0, N), rng.normal(0.0, 1.0, N)]) for _ in range(3)]
    seeds = [Seed(ids[:N], ids[N:], [s[:N]], [s[N:]]) for s in scores]
    groups = [Drawn(s[:N], s[N:]) for s in scores]
    stat = member_stat(metric)
    assert stat is not None

    def make():
        return {
            "nested": lambda: hierarchical(groups, lambda g, b, r: stat.drawn(g, *_draws(g, b, r)), rng, B),
            "pigeonhole": lambda: pigeonhole(seeds, stat, rng, B),
        }

    med = _race(benchmark, make)
    ratio = med["pigeonhole"] / med["nested"]
    benchmark.extra_info.update(cost_ratio=ratio)
    print(
        f"\n{metric}, 3 seeds x {N} + {N}, {B} replicates: nested {med['nested'] * 1e3:.1f} ms, pigeonhole "
        f"{med['pigeonhole'] * 1e3:.1f} ms: {ratio:.2f}x the time"
    )


def _draws(g: Drawn, b: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, len(g.pos), (b, len(g.pos))), rng.integers(0, len(g.neg), (b, len(g.neg)))
