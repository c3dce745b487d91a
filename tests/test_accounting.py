"""bench/accounting.py: the per-release Gaussian-mechanism formula and opacus-composed epsilon."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import RDPAccountant

from bench.accounting import (
    RDP_ALPHAS,
    combined_noise_multiplier,
    composed_epsilon,
    gaussian_epsilon,
    gaussian_sigma,
    noise_multiplier_for,
)


def test_gaussian_sigma_classic_formula():
    # sqrt(2 ln(1.25 / 1e-5)) = sqrt(2 * 11.7361) = 4.84481
    assert math.isclose(gaussian_sigma(1.0, 1e-5, 1.0), 4.84481, rel_tol=1e-5)
    assert math.isclose(gaussian_sigma(2.0, 1e-5, 3.0), 1.5 * 4.84481, rel_tol=1e-5)  # linear in S / epsilon
    assert math.isclose(gaussian_epsilon(gaussian_sigma(7.0, 1e-3, 0.1), 1e-3, 0.1), 7.0, rel_tol=1e-12)
    assert gaussian_epsilon(0.0, 1e-5, 1.0) == math.inf
    with pytest.raises(ValueError):
        gaussian_sigma(1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        gaussian_sigma(0.0, 1e-5, 1.0)


def test_composed_epsilon_matches_direct_opacus_accountant():
    z, q, steps, delta = 1.1, 0.1, 50, 1e-5
    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=z, sample_rate=q)
    direct = acc.get_epsilon(delta=delta, alphas=RDP_ALPHAS)
    assert math.isclose(composed_epsilon(z, q, steps, delta), direct, rel_tol=1e-9)
    # the extended orders can only tighten opacus' default bound
    assert composed_epsilon(z, q, steps, delta) <= acc.get_epsilon(delta=delta) + 1e-9


def test_composed_epsilon_monotone():
    eps_rounds = [composed_epsilon(1.0, 0.2, r, 1e-5) for r in (1, 5, 20, 100)]
    assert all(a < b for a, b in zip(eps_rounds, eps_rounds[1:]))
    eps_noise = [composed_epsilon(z, 0.2, 20, 1e-5) for z in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(eps_noise, eps_noise[1:]))
    eps_rate = [composed_epsilon(1.0, q, 20, 1e-5) for q in (0.05, 0.2, 1.0)]
    assert all(a < b for a, b in zip(eps_rate, eps_rate[1:]))
    assert composed_epsilon(1.0, 0.2, 0, 1e-5) == 0.0
    with pytest.raises(ValueError):
        composed_epsilon(1.0, 0.0, 10, 1e-5)


def test_noise_multiplier_for_inverts_composition():
    z = noise_multiplier_for(4.0, 1e-5, 0.1, 200)
    eps = composed_epsilon(z, 0.1, 200, 1e-5)
    assert 4.0 - 0.02 <= eps <= 4.0  # opacus bisection tolerance 0.01
    assert noise_multiplier_for(2.0, 1e-5, 0.1, 200) > z  # a smaller budget needs more noise


def test_combined_noise_multiplier():
    assert math.isclose(combined_noise_multiplier([1.0, 1.0], [1.0, 1.0]), 1 / math.sqrt(2))
    # rescaling a block (S, sigma) -> (cS, c sigma) changes nothing
    assert math.isclose(combined_noise_multiplier([0.1, 2.0], [0.3, 6.0]), combined_noise_multiplier([1, 1], [3, 3]))
    # the whole message is never more private than any of its blocks
    z = combined_noise_multiplier([1.0] * 16, [2.0] * 16)
    assert math.isclose(z, 2.0 / 4.0)
    assert composed_epsilon(z, 0.1, 10, 1e-5) > composed_epsilon(2.0, 0.1, 10, 1e-5)
