"""The empirical epsilon audit (bench/audit.py, bench/report/audit.py): the bound on constructed ROC data,
on a mechanism of known epsilon, and a broken DP mechanism caught as a violation by the leaderboard."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.accounting import gaussian_sigma
from bench.audit import DEFAULT_DELTA, audit_delta, cp_lower, cp_upper, epsilon_lower_bound, record_bound
from bench.report import claims
from bench.report.audit import dp_rows, row_audit
from bench.report.markdown import audit_banner
from bench.report.results import Results
from bench.report.tables import scenario_table


def test_perfect_separation_matches_the_closed_form_clopper_pearson_bound():
    # arrange: 100 members at 1, 100 non-members at 0: one threshold, two forms -> m = 2 tests, and each
    # rate's one-sided level is a = 0.05 / (2 m); with k = n the CP lower bound is a^(1/n), with k = 0 the
    # upper bound is 1 - a^(1/n)
    y = [1] * 100 + [0] * 100
    a = 0.05 / 4
    lo = a ** (1 / 100)
    # act
    b = epsilon_lower_bound([1.0] * 100 + [0.0] * 100, y, delta=0.0)
    b_delta = epsilon_lower_bound([1.0] * 100 + [0.0] * 100, y, delta=0.01)
    # assert
    assert b.n_tests == 2 and b.threshold == 1.0 and b.confidence == 0.95
    assert b.value == pytest.approx(math.log(lo / (1 - lo)), rel=1e-9)  # 3.1057
    assert b.value == pytest.approx(3.10567, abs=1e-4)
    assert b_delta.value == pytest.approx(math.log((lo - 0.01) / (1 - lo)), rel=1e-9)


def test_the_complement_test_is_used_when_it_is_stronger():
    # arrange: every member scores 1; half the non-members score 0. "score >= 1" has TPR 1, FPR 0.5 (eps ~ log 2);
    # its complement "non-member iff score < 1" has TNR 0.5, FNR 0: a much larger bound
    s = [1.0] * 100 + [1.0] * 50 + [0.0] * 50
    y = [1] * 100 + [0] * 100
    a = 0.05 / 4
    # act
    b = epsilon_lower_bound(s, y, delta=DEFAULT_DELTA)
    # assert: TNR's CP lower bound at k = 50 of 100 is beyond a closed form; check its ingredients instead
    assert b.form == "complement"
    assert b.fpr_high == pytest.approx(1 - a ** (1 / 100), rel=1e-9)
    assert b.value == pytest.approx(math.log((b.tpr_low - DEFAULT_DELTA) / b.fpr_high), rel=1e-9)
    assert 0.3 < b.tpr_low < 0.5 and b.value > math.log(2)


def test_no_leakage_gives_zero_and_more_tests_give_a_smaller_bound():
    # arrange
    same = epsilon_lower_bound([0.5] * 20, [1] * 10 + [0] * 10, delta=1e-5)
    s, y = [1.0] * 100 + [0.0] * 100, [1] * 100 + [0] * 100
    # act
    one, many = epsilon_lower_bound(s, y, delta=0.0), epsilon_lower_bound(s, y, delta=0.0, tests=10)
    # assert
    assert same.value == 0.0 and same.threshold is None
    assert 0 < many.value < one.value and many.n_tests == 20


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"scores": [float("nan"), 1.0]}, "NaN"),
        ({"delta": 1.0}, "delta"),
        ({"confidence": 1.0}, "confidence"),
        ({"members": [0, 2]}, "0/1"),
    ],
)
def test_bad_inputs_name_the_problem(bad, msg):
    kw = {"scores": [0.0, 1.0], "members": [0, 1], "delta": 1e-5, **bad}
    with pytest.raises(ValueError, match=msg):
        epsilon_lower_bound(kw.pop("scores"), kw.pop("members"), **kw)


def test_randomised_response_with_epsilon_one_audits_between_zero_and_one():
    # arrange: members answer 1 w.p. e/(1+e), non-members w.p. 1/(1+e): exactly epsilon = 1 (delta 0)
    rng = np.random.default_rng(0)
    n, p = 20_000, math.e / (1 + math.e)
    s = np.concatenate([rng.random(n) < p, rng.random(n) < 1 - p]).astype(float)
    y = np.r_[np.ones(n, int), np.zeros(n, int)]
    # act
    b = epsilon_lower_bound(s, y, delta=DEFAULT_DELTA)
    # assert: a valid lower bound, and a tight one with 20k per side
    assert 0.9 < b.value <= 1.0


def _gaussian_mean_scores(*, sigma_divisor: float, n_trials: int, seed: int) -> tuple[list[float], list[int], float]:
    """A toy DP mean of 100 values in [0, 1], claimed (1, 1e-5)-DP; the target record is 1 (member) or 0."""
    rng = np.random.default_rng(seed)
    n, delta = 100, 1e-5
    sigma = gaussian_sigma(1.0, delta, 1.0 / n) / sigma_divisor
    rest = rng.random((2 * n_trials, n - 1)).sum(axis=1)
    target = np.r_[np.ones(n_trials), np.zeros(n_trials)]
    released = (rest + target) / n + rng.normal(0.0, sigma, 2 * n_trials)
    score = released - rest / n  # the attacker knows the other records (the audit's worst case)
    return score.tolist(), target.astype(int).tolist(), delta


def _dp_record(defense: str, scores: list[float], members: list[int], delta: float, *, claimed: float) -> dict:
    return {
        "cell_id": f"toy-{defense}",
        "scenario": "toy",
        "task": "toy/mean",
        "preset": "smoke",
        "seed": 0,
        "defense": defense,
        "defense_params": {},
        "defense_label": defense,
        "attack": "mean_mia",
        "attack_params": {},
        "attack_label": "mean_mia",
        "attack_kind": "membership",
        "view": "global_model",
        "status": "ok",
        "reason": "",
        "utility": {"accuracy": 0.5},
        "cost": {},
        "privacy": {
            "epsilon": claimed,
            "epsilon_composed": claimed,
            "delta": delta,
            "note": "",
            "epsilon_lower_bound": record_bound({"score": scores, "member": members}, delta=delta, attack="mean_mia"),
        },
        "metrics": {"auroc": {"value": 0.5, "ci_low": 0.4, "ci_high": 0.6}},
        "primary": "score",
        "per_candidate": {"score": scores, "member": members},
        "provenance": {"code_version": "test", "config_hash": "cfg", "started_at": "2026-01-01T00:00:00Z"},
    }


def test_a_broken_dp_mechanism_is_caught_as_a_violation_and_a_correct_one_is_not():
    # arrange: the same claimed epsilon 1; one mechanism's noise scale divided by 100
    broken = _dp_record("dp_broken", *_gaussian_mean_scores(sigma_divisor=100, n_trials=2000, seed=1), claimed=1.0)
    honest = _dp_record("dp_honest", *_gaussian_mean_scores(sigma_divisor=1, n_trials=2000, seed=2), claimed=1.0)
    # act
    au_broken, au_honest = row_audit([broken]), row_audit([honest])
    table, _ = scenario_table(Results([broken, honest]), "toy")
    rows = dp_rows(table, "toy")
    banner = audit_banner(table)
    page = claims.markdown([], rows)
    # assert
    assert broken["privacy"]["epsilon_lower_bound"]["value"] > 3 and au_broken["lower_bound"] > 3
    assert au_broken["violation"] and not au_honest["violation"]
    assert 0.0 <= au_honest["lower_bound"] <= 1.0
    assert dict(zip(table.defense, table.dp_violation)) == {"dp_broken": True, "dp_honest": False}
    assert len(banner) == 2 and "DP VIOLATION" in banner[0] and "dp_broken" in banner[0]
    assert "DP VIOLATION: toy/mean dp_broken" in page and "dp_honest" in page
    assert [r["violation"] for r in rows] == [True, False] and "VIOLATION" in rows[0]["tightness"]


def test_row_bound_is_bonferroni_corrected_over_its_cells_and_undefended_rows_use_the_default_delta():
    # arrange: an undefended row (no epsilon claimed) with two cells of the same strong attack
    s, y, _ = _gaussian_mean_scores(sigma_divisor=100, n_trials=200, seed=3)
    r1 = _dp_record("fedavg", s, y, 1e-5, claimed=1.0)
    r1["privacy"] = {"epsilon": None, "epsilon_composed": None, "delta": None, "note": ""}
    r2 = {**r1, "cell_id": "toy-fedavg-2", "view": "client_model"}
    # act
    au = row_audit([r1, r2])
    # assert
    assert audit_delta(None) == DEFAULT_DELTA and au["delta"] == DEFAULT_DELTA
    assert au["claimed"] is None and not au["violation"] and au["n_cells"] == 2
    assert au["lower_bound"] == pytest.approx(epsilon_lower_bound(s, y, delta=DEFAULT_DELTA, tests=2).value)
    assert au["lower_bound"] < epsilon_lower_bound(s, y, delta=DEFAULT_DELTA).value


@pytest.mark.parametrize("n", [1, 2, 7, 64, 250, 1000])
@pytest.mark.parametrize("alpha", [0.05, 0.025, 0.05 / 8, 1e-4])
def test_clopper_pearson_bounds_equal_scipy_stats_beta_bit_for_bit(n, alpha):
    from scipy.stats import beta

    k = np.arange(n + 1, dtype=float)

    lo, hi = cp_lower(k, n, alpha), cp_upper(k, n, alpha)

    with np.errstate(invalid="ignore"):
        want_lo = np.where(k <= 0, 0.0, beta.ppf(alpha, k, n - k + 1))
        want_hi = np.where(k >= n, 1.0, beta.ppf(1.0 - alpha, k + 1, n - k))
    assert np.array_equal(lo, want_lo) and np.array_equal(hi, want_hi)
