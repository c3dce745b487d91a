"""Privacy accounting for the DP defenses (docs/design.md s.5): the papers' per-release Gaussian-mechanism
epsilon, and epsilon composed over all rounds with client sampling by an opacus RDP accountant.

Per release ([DP-FedLoRA] Eq. 9-11, [FLRSP] Eq. 6; Dwork & Roth 2014, Thm. A.1):
    sigma = sqrt(2 ln(1.25 / delta)) * sensitivity / epsilon.
Dwork & Roth prove this bound for epsilon < 1 only; papers use it at epsilon 5-25, where it is a formula,
not a theorem. The composed number (Mironov 2017 RDP of the sampled Gaussian mechanism, as in
Abadi et al. 2016 / McMahan et al. 2018 for client-level DP-FedAvg) is valid at every epsilon:
one "step" is one round, ``sample_rate`` = clients_per_round / num_clients, and
``noise_multiplier`` = noise std / L2 sensitivity of a whole client message.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

# RDP orders: opacus' defaults (1.1 ... 10.9, 12 ... 63) extended towards 1 and upwards, so that the optimum
# is interior both for the weak-noise regime of large-epsilon papers and for strong noise.
RDP_ALPHAS: list[float] = (
    [1.01, 1.02, 1.05]
    + [1 + x / 10.0 for x in range(1, 100)]
    + [float(a) for a in range(12, 64)]
    + [64.0, 96.0, 128.0, 256.0, 512.0, 1024.0]
)


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Noise std of the classic Gaussian mechanism for one (epsilon, delta) release ([FLRSP] Eq. 6)."""
    _check_delta(delta)
    if epsilon <= 0 or sensitivity < 0:
        raise ValueError(f"need epsilon > 0 and sensitivity >= 0, got epsilon={epsilon}, sensitivity={sensitivity}")
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon


def gaussian_epsilon(sigma: float, delta: float, sensitivity: float) -> float:
    """Inverse of :func:`gaussian_sigma`: the per-release epsilon that noise std ``sigma`` buys."""
    _check_delta(delta)
    if sigma <= 0:
        return math.inf
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / sigma


def combined_noise_multiplier(sensitivities: Sequence[float], sigmas: Sequence[float]) -> float:
    """Noise multiplier of one release made of several independently noised blocks.

    Block i has L2 sensitivity S_i and noise std sigma_i; rescaling block i by 1/sigma_i gives a Gaussian
    mechanism with unit noise and sensitivity sqrt(sum_i (S_i/sigma_i)^2), hence
    z = 1 / sqrt(sum_i (S_i / sigma_i)^2).
    """
    if len(sensitivities) != len(sigmas) or not sigmas:
        raise ValueError("need one sigma per sensitivity, at least one block")
    total = 0.0
    for s, sig in zip(sensitivities, sigmas):
        if sig <= 0 and s > 0:
            return 0.0
        total += (s / sig) ** 2 if s > 0 else 0.0
    return math.inf if total == 0 else 1.0 / math.sqrt(total)


def composed_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, *, accountant: str = "rdp"
) -> float:
    """Epsilon after ``steps`` sampled Gaussian releases (opacus accountant, default RDP)."""
    _check_delta(delta)
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if steps == 0 or math.isinf(noise_multiplier):
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import create_accountant  # lazy: opacus pulls in torch.distributed (start-up)

    acc = create_accountant(mechanism=accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    # the RDP -> (eps, delta) conversion goes below 0 for a large delta (e.g. 0.5): (eps < 0, delta)-DP
    # implies (0, delta)-DP, and the harness rejects a negative epsilon as a defense bug
    return max(0.0, float(acc.get_epsilon(delta=delta, **_accountant_kwargs(accountant))))


def noise_multiplier_for(
    epsilon: float, delta: float, sample_rate: float, steps: int, *, accountant: str = "rdp"
) -> float:
    """Smallest noise multiplier (opacus binary search, tolerance 0.01 in epsilon) reaching ``epsilon``
    after ``steps`` releases at ``sample_rate``."""
    _check_delta(delta)
    if epsilon <= 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    from opacus.accountants.utils import get_noise_multiplier  # lazy (start-up)

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=int(steps),
            accountant=accountant,
            **_accountant_kwargs(accountant),
        )
    )


def _accountant_kwargs(accountant: str) -> dict:
    return {"alphas": RDP_ALPHAS} if accountant == "rdp" else {}


def privacy_record(
    defense: Any, *, delta: float, rounds: int, sample_rate: float, names: Sequence[str] | None, n_samples: int
) -> dict[str, Any]:
    """The ``privacy`` block of a result record, from accountant inputs the harness computed.

    ``epsilon_composed`` assumes amplification by client sampling (``sample_rate`` < 1), which holds
    against an outside observer of the released models; an honest-but-curious server knows which client
    sent each message, so against it only ``epsilon_composed_no_amplification`` (sample rate 1) holds.
    """
    eps = defense.epsilon(delta=delta)
    if eps is None:
        return {
            "epsilon": None,
            "epsilon_composed": None,
            "epsilon_composed_no_amplification": None,
            "delta": None,
            "sample_rate": None,
            "rounds": None,
            "sensitivity": "",
            "note": "",
        }

    def composed(rate: float) -> float | None:
        return defense.epsilon_composed(delta=delta, rounds=rounds, sample_rate=rate, names=names)

    comp = composed(sample_rate)
    no_amp = comp if sample_rate == 1.0 else composed(1.0)
    note = f"delta={delta:g} >= 1/n: no meaningful guarantee" if delta >= 1.0 / max(1, n_samples) else ""
    return {
        "epsilon": eps,
        "epsilon_composed": comp,
        "epsilon_composed_no_amplification": no_amp,
        "delta": delta,
        "sample_rate": sample_rate,
        "rounds": int(rounds),
        "sensitivity": defense.sensitivity_note(),
        "note": note,
    }
