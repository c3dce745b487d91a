"""The one-run audit (bench/one_run_audit.py, Steinke et al. 2023 on member / non-member pairs): the p-value
against hand-computed values, the bound on mechanisms of known epsilon, its validity under the null, the
pairing, and the leaderboard's use of it (a broken DP mechanism flagged, old records n/a)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.one_run_audit import auditable, one_run_bound, p_value, pair_candidates
from bench.report.audit import dp_rows, row_audit
from bench.report.results import Results
from bench.report.tables import scenario_table
from tests.test_audit import _dp_record, _gaussian_mean_scores


def test_p_value_matches_hand_computed_values():
    # arrange / act / assert: 10 of 10 right at epsilon 0 is 2^-10; with delta, Appendix D's term:
    # m=4, r=2, v=2, q=1/2: tail 1/4; windows P[2 > B >= 1] / 1 = 1/2, P[2 > B >= 0] / 2 = 3/8 -> 1/4 + 2*4*0.01*1/2
    assert p_value(m=10, r=10, v=10, epsilon=0.0, delta=0.0) == pytest.approx(2**-10, rel=1e-12)
    assert p_value(m=4, r=2, v=2, epsilon=0.0, delta=0.01) == pytest.approx(0.29, rel=1e-12)
    q = 1 / (1 + math.exp(-1.0))
    assert p_value(m=5, r=5, v=5, epsilon=1.0, delta=0.0) == pytest.approx(q**5, rel=1e-12)
    assert p_value(m=5, r=5, v=0, epsilon=1.0, delta=0.1) == 1.0


def test_perfect_pairs_give_the_closed_form_bound():
    # arrange: 100 pairs, every member above its non-member: grid k = 10, 25, 50, 100 -> 4 tests, alpha 0.05/4;
    # all 100 right is rejected iff q^100 <= alpha with q = 1/(1+e^(-2 eps)) (a coin flip is a replacement)
    y = np.r_[np.ones(100, int), np.zeros(100, int)]
    s = np.r_[np.linspace(2, 3, 100), np.linspace(0, 1, 100)]
    q = (0.05 / 4) ** (1 / 100)
    # act
    b = one_run_bound(s, y, delta=0.0, seed=0)
    # assert
    assert (b.pairs, b.guesses, b.correct, b.n_tests) == (100, 100, 100, 4)
    assert b.value == pytest.approx(0.5 * math.log(q / (1 - q)), abs=1e-6)


def _randomised_response(eps: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each candidate reports its membership bit through randomised response: exactly eps-DP under add/remove."""
    rng = np.random.default_rng(seed)
    y = np.r_[np.ones(n, int), np.zeros(n, int)]
    keep = rng.random(2 * n) < math.exp(eps) / (1 + math.exp(eps))
    return np.where(keep, y, 1 - y).astype(float), y


def test_randomised_response_with_epsilon_one_audits_between_zero_and_one():
    # arrange: 5,000 pairs of an exactly 1-DP mechanism
    s, y = _randomised_response(1.0, 5000, seed=0)
    # act
    b = one_run_bound(s, y, delta=1e-5, seed=0)
    # assert: a valid bound (<= 1), and informative with this many pairs
    assert 0.7 < b.value <= 1.0


def test_under_the_null_the_bound_is_zero_at_least_about_95_percent_of_the_time():
    # arrange: scores independent of membership, 200 repetitions of 100 pairs
    rng = np.random.default_rng(1)
    y = np.r_[np.ones(100, int), np.zeros(100, int)]
    # act
    positive = sum(one_run_bound(rng.normal(size=200), y, delta=1e-5, seed=i).value > 0 for i in range(200))
    # assert: at most 5% expected (Bonferroni makes it fewer); 20 of 200 is far in the tail
    assert positive <= 20


def test_pairs_stay_within_a_class_and_ignore_the_scores():
    # arrange: classes 0 / 1; class 1 has 3 members but 1 non-member
    y = [1, 1, 1, 1, 0, 0, 0, 0]
    strata = [0, 1, 1, 1, 0, 0, 1, 0]
    # act
    pairs = pair_candidates(y, strata, seed=3)
    # assert: one pair per (member, non-member) of a class, each item once, deterministic by seed
    assert len(pairs) == 2 and all(strata[a] == strata[b] and y[a] == 1 and y[b] == 0 for a, b in pairs)
    assert pairs == pair_candidates(y, strata, seed=3)
    b1 = one_run_bound([0.1, 9, 9, 9, 0, 0, 0, 0], y, strata, delta=0.0, seed=3)
    assert b1.pairs == 2 and b1.stratified
    with pytest.raises(ValueError, match="strata must match"):
        pair_candidates(y, [0, 1], seed=0)


def _record(defense: str, scores, members, *, claimed: float, revision: int | None) -> dict:
    """test_audit's toy DP record, written at schema ``revision`` (3: the one-run audit applies)."""
    return {**_dp_record(defense, list(scores), list(members), 1e-5, claimed=claimed), "schema_revision": revision}


def _gaussian_mean(sigma_divisor: float, n_trials: int, seed: int) -> tuple[list[float], list[int]]:
    """test_audit's (1, 1e-5)-DP toy mean (noise divided by ``sigma_divisor``): scores and membership."""
    scores, members, _ = _gaussian_mean_scores(sigma_divisor=sigma_divisor, n_trials=n_trials, seed=seed)
    return scores, members


def test_a_broken_dp_mechanism_is_flagged_by_the_one_run_bound_and_old_records_are_not_audited():
    # arrange: claimed epsilon 1; one mechanism's noise divided by 100; a record written before revision 3
    broken = _record("dp_broken", *_gaussian_mean(100, 1000, seed=2), claimed=1.0, revision=3)
    honest = _record("dp_honest", *_gaussian_mean(1, 1000, seed=3), claimed=1.0, revision=3)
    old = _record("dp_old", *_gaussian_mean(100, 1000, seed=2), claimed=1.0, revision=2)
    # act
    au_b, au_h, au_o = row_audit([broken]), row_audit([honest]), row_audit([old])
    table, _ = scenario_table(Results([broken, honest, old]), "toy")
    rows = {r["defense"]: r for r in dp_rows(table, "toy")}
    # assert
    assert auditable(broken) and not auditable(old)
    assert au_b["one_run_lower_bound"] > 1.0 and au_b["violation"]
    assert 0.0 <= au_h["one_run_lower_bound"] <= 1.0
    assert au_o["one_run_lower_bound"] is None and au_o["one_run_attack"] is None
    assert rows["dp_old"]["one_run"].startswith("n/a") and "pairs" in rows["dp_broken"]["one_run"]


def test_tightness_uses_the_larger_of_the_two_bounds():
    # arrange / act / assert: a one-run bound above the ROC bound sets the ratio
    from bench.report.audit import tightness

    assert tightness({"claimed": 2.0, "lower_bound": 0.5, "one_run_lower_bound": 1.0, "violation": False}).endswith(
        "= 2x"
    )
    assert "= 4x" in tightness({"claimed": 2.0, "lower_bound": 0.5, "one_run_lower_bound": None, "violation": False})
