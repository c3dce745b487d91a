"""Reference-model membership inference: RMIA ([RMIA], offline) with LiRA offline ([LiRA]) as a variant.

Signal p(x | theta) = exp(-loss(x; theta)) from ``bench.loss_signals.per_sample_losses``: image classification,
the softmax probability of the true label (exp(-cross-entropy)); LM / VLM, the per-token geometric mean of
the sequence likelihood (exp(-mean token NLL)); diffusion, exp(-mean denoising MSE over ``timesteps``
stratified steps with the cell's seeded noise, the same noise for the target and every reference model):
a Gaussian-likelihood-like score, monotone in the loss.

RMIA ([RMIA], offline): Pr(x) = ((1 + a) mean_r p(x | theta_r) + (1 - a)) / 2 over OUT reference
models (every reference model is OUT for every candidate and every z, ``bench.reference``), the same for
each population sample z; LR(x, z) = [p(x|theta) / Pr(x)] / [p(z|theta) / Pr(z)];
score = fraction of z with LR(x, z) >= gamma. Constants as in the authors' code (privacytrustlab/
ml_privacy_meter): the offline Pr(x) above is attacks.py:118/132 and modules/mia/attacks/rmia.py:131/141 (from
P_IN ~ a P_OUT + (1 - a), documentation/mia.md). ``a`` is tuned per cell as the authors' audit does before every
attack (audit.py, attacks.py tune_offline_a): one reference model, whose training data the attacker chose, is
attacked with the other reference models for a = 0, 0.1, ..., 1, and the a of the highest AUROC is kept
(:func:`tune_a`; here reference 0's members against training-pool items it did not draw, each item's reference
mean over the models that did not train on it, since our reference models draw overlapping sets rather than the
library's complementary pairs). A fixed a mattered: with a = 0.3 (the library's configured default,
modules/mia/README.md:6, and the paper's CIFAR-10 setting) and LM likelihoods p = exp(-mean token NLL) ~ 0.01-0.1,
Pr(x) is ~ (1 - a) / 2 for every x, the reference models drop out and RMIA ranked llm-text candidates as the loss
attack did (Spearman 0.9999, AUROC within 0.01 on every default record, session 2026-11-28) while offline LiRA
reached 0.81-0.94 where RMIA had 0.70-0.80. Where there is nothing to tune on (a base-model target, R = 1)
a = 0.3. gamma = 1 is
the library's (run_rmia counts ratios > 1.0, attacks.py:136 and modules/mia/attacks/rmia.py:145;
documentation/mia.md:94 "the default value of gamma is 1"); the paper's experiment code uses 2
(research/2024_rmia/README.md:121, all 59 attack configs) with another signal (temperature-2 Taylor softmax,
18 augmented queries, majority vote). With one query the score is F_z(ratio_x - log gamma), F_z the empirical
CDF of the z ratios: gamma never reorders candidates, it only moves where the score saturates at 0 and 1, and
on our exp(-loss) signal gamma = 2 saturates: every score 0 (AUROC 0.500) in 5 of the 8 image-cls smoke rmia
cells, against none with 1. The z samples are the whole z pool (top_k = -1, README.md:118; the library's
population_size defaults to all too). The paper's score counts LR >= gamma (documentation/mia.md:92); the
code's strict > differs on exact ties only.

Augmented queries (``queries`` > 1, image classifiers only): each candidate and each z is also scored
mirrored and shifted by one pixel (reflect padding), the queries [RMIA]'s experiments (18 on CIFAR: mirror x
shifts, majority vote) and [LiRA] (s.5: mirror x shifts) use. Every query gets its own signal from the target
and the reference models; RMIA's score is the mean over queries of the per-query score (a soft majority
vote), LiRA's the mean over queries of the per-query one-sided log-probability (each query its own Gaussian).
``neg_loss`` stays the unaugmented single-signal score. The default 1 is the attack without augmentation.
The queries help only against a target trained with those augmentations: measured on image-cls `default`
(FedAvg, 3 seeds, 250 + 250 candidates, clients train without augmentation) ``queries=2`` lowered RMIA's AUROC
from 0.73-0.76 to 0.66-0.72 and LiRA's from 0.73-0.77 to 0.69-0.71 (session 2026-11-26): to a model that
never saw a mirrored image, a mirrored member looks like a non-member.

LiRA offline ([LiRA], Algorithm 1 offline): phi = log(p / (1 - p)) (logit scaling), a Gaussian
N(mu_x, sigma^2) fitted over the OUT reference models' phi(x); one-sided test, score = log Pr[N(mu_x, sigma^2)
<= phi_target(x)]. With few reference models sigma is the global one (std of every reference phi: the paper's
fixed variance, ``fix_variance`` in the authors' code, tensorflow/privacy research/mi_lira_2021/plot.py
generate_ours_offline). That code fits mu with the median (equal to the mean for R <= 2), sigma with np.std
(ddof 0; we use ddof 1, a constant factor: the same ranking) and scores -logpdf (two-sided); we follow the
paper's one-sided test and mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from bench.loss_signals import cell_losses, loss_timesteps
from bench.params import param
from bench.progress import progress
from bench.reference import default_count, population_reason
from bench.registry import register_attack
from bench.types import Attack, Observation, Scores, TaskSpec

A_GRID = tuple(i / 10 for i in range(11))  # the a values [RMIA]'s code tries (tune_offline_a: 0, 0.1, ..., 1)
UNTUNED_A = 0.3  # where there is nothing to tune on (module doc)


def offline_pr(p_refs: Tensor, a: float) -> Tensor:
    """[RMIA]'s offline approximation of Pr(x) from OUT models' p(x | theta_r) [N, R]: ((1+a) mean + 1-a) / 2."""
    return _pr(p_refs.double().mean(1), a)


def _pr(mean_out: Tensor, a: float) -> Tensor:
    return 0.5 * ((1.0 + a) * mean_out.double() + (1.0 - a))


def _scores(p_target: Tensor, mean_x: Tensor, pz_target: Tensor, mean_z: Tensor, a: float, gamma: float) -> Tensor:
    rx = torch.log(p_target.double()) - torch.log(_pr(mean_x, a))
    rz = torch.log(pz_target.double()) - torch.log(_pr(mean_z, a))
    return ((rx[:, None] - rz[None, :]) >= torch.log(torch.tensor(gamma, dtype=torch.float64))).double().mean(1)


def rmia_scores(
    p_target: Tensor, p_refs: Tensor, pz_target: Tensor, pz_refs: Tensor, *, a: float, gamma: float
) -> Tensor:
    """[N] RMIA scores: for each x, the fraction of z with LR(x, z) >= gamma (computed in log space)."""
    return _scores(p_target, p_refs.double().mean(1), pz_target, pz_refs.double().mean(1), a, gamma)


def tune_a(
    p_refs: Tensor, out: Tensor, member: Tensor, pz_refs: Tensor, *, gamma: float
) -> tuple[float, dict[str, float]]:
    """[RMIA]'s offline ``a`` as its authors' code picks it (tune_offline_a, module doc): attack reference model 0
    (column 0 of the likelihoods ``p_refs`` [M, R] of items whose membership ``member`` [M] the attacker knows; of
    ``pz_refs`` [Z, R] for the z samples) with the other reference models, each item's mean over those that did
    not train on it (``out`` [M, R-1]), for every a in :data:`A_GRID`; returns the a of the highest AUROC (the
    smallest on ties) and each a's AUROC. Items no other reference model is OUT for are left out."""
    from sklearn.metrics import roc_auc_score  # lazy: sklearn costs seconds at start-up

    keep = out.any(1)
    if int(member[keep].sum()) == 0 or int((~member[keep]).sum()) == 0:
        raise ValueError("tuning a needs members and non-members with an OUT reference model each")
    w = out[keep].double()
    mean_x = (p_refs[keep, 1:].double() * w).sum(1) / w.sum(1)
    mean_z = pz_refs[:, 1:].double().mean(1)
    y = member[keep].numpy()
    aurocs = {
        f"{a:.1f}": float(roc_auc_score(y, _scores(p_refs[keep, 0], mean_x, pz_refs[:, 0], mean_z, a, gamma).numpy()))
        for a in A_GRID
    }
    best = max(A_GRID, key=lambda a: (aurocs[f"{a:.1f}"], -a))
    return best, aurocs


def logit_from_loss(loss: Tensor) -> Tensor:
    """phi = log(p / (1 - p)) with p = exp(-loss), stably: -loss - log(1 - exp(-loss))."""
    loss = loss.double().clamp(min=1e-12)
    return -loss - torch.log(-torch.expm1(-loss))


def lira_offline_scores(phi_target: Tensor, phi_refs: Tensor, *, global_variance: bool) -> Tensor:
    """[N] one-sided offline LiRA: log Pr[N(mu_x, sigma^2) <= phi_target] with mu_x the OUT mean of [N, R]
    reference logits; sigma per candidate, or the global std when ``global_variance`` or R = 1."""
    phi_refs = phi_refs.double()
    mu = phi_refs.mean(1)
    if global_variance or phi_refs.shape[1] < 2:
        sd = phi_refs.std().expand_as(mu) if phi_refs.numel() > 1 else torch.ones_like(mu)
    else:
        sd = phi_refs.std(1)
    z = (phi_target.double() - mu) / sd.clamp(min=1e-12)
    from scipy.stats import norm  # lazy: scipy.stats costs seconds at start-up

    return torch.from_numpy(norm.logcdf(z.numpy()))


def queries_of(n: int) -> list[tuple[bool, int, int]]:
    """The first ``n`` augmented queries (mirror, dx, dy): the image itself, its mirror, then one-pixel shifts
    of both (2 x 9 = 18 in all, [RMIA]'s CIFAR count)."""
    shifts = [(0, 0)] + [(dx, dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1) if (dx, dy) != (0, 0)]
    return [(mirror, dx, dy) for dx, dy in shifts for mirror in (False, True)][:n]


def augmented(item: Any, query: tuple[bool, int, int]) -> Any:
    """An image classifier's candidate ``(x [C, H, W], label)`` mirrored left-right and shifted by (dx, dy)
    pixels, the uncovered border reflected."""
    mirror, dx, dy = query
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Tensor) and item[0].dim() == 3):
        raise ValueError(f"augmented queries need (image [C, H, W], label) candidates, got {type(item).__name__}")
    x, y = item
    if mirror:
        x = x.flip(-1)
    if dx or dy:
        h, w = x.shape[-2:]
        x = F.pad(x[None], (1, 1, 1, 1), mode="reflect")[0][:, 1 - dy : 1 - dy + h, 1 - dx : 1 - dx + w]
    return (x, y)


@register_attack
@dataclass
class RMIA(Attack):
    n_reference: int | None = param(None, ge=1, le=256)  # R; None = the preset's (2 on smoke, 4 elsewhere)
    gamma: float = param(1.0, gt=0.0, le=1000.0)  # LR threshold ([RMIA]'s code: 1, module doc)
    a: float | None = param(None, ge=0.0, le=1.0)  # offline Pr(x) approximation; None: tuned per cell (module doc)
    n_tune: int = param(128, ge=2, le=100_000, added=True)  # reference 0 members (and non-members) to tune a on
    n_population: int | None = param(None, ge=1, le=1_000_000)  # z samples; None = the whole z pool ([RMIA])
    lira_global_variance: bool = True  # [LiRA]: a global variance with few reference models
    timesteps: int = param(10, ge=0, le=1000)  # diffusion steps of the loss (only with api.diffusion_ops)
    batch_size: int = param(16, ge=1, le=4096)
    queries: int = param(1, ge=1, le=18, added=True)  # augmented queries per candidate (image classifiers)

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    paper = (
        "[RMIA] (Zarifzadeh et al. 2024), offline RMIA; [LiRA] (Carlini et al. 2022) offline LiRA as a "
        "variant; reference models trained on population data with the target's recipe"
    )
    uses_reference = True  # the harness puts a bench.reference.Reference in obs.reference
    # a conformance run's caps (bench.conformance.cap_budget): one reference run, few z, few diffusion steps
    budget = {"n_reference": 1, "n_population": 64, "timesteps": 2}

    def applies(self, task: TaskSpec) -> str | None:
        if self.queries > 1 and task.family != "image-cls":
            return f"augmented queries (queries={self.queries}) need an image classifier; {task.family} has none"
        return population_reason(task)

    def relative_cost(self, task: Any, view: str) -> float:
        """A cell's scoring passes on a trained target over those of the base-model cell of the same view (whose
        reference models are the base model: the candidates and z samples scored once): the plan's first
        estimate of such a cell from a measured base-model one (bench.costs.CostModel). The target and each
        of the R reference models score the candidates and the z samples (client view: every client's model
        all z samples beside its own candidates), and each reference model reference 0's tuning items."""
        r = self.n_reference or default_count(task.preset)
        c = 2 * task.max_membership
        pop = len(task.population) if task.population is not None else 2 * c
        z = self.n_population or pop - pop // 2  # bench.reference.population_split: the z pool
        k = task.fl.num_clients if view == "client_model" else 1
        tune = 2 * self.n_tune * r * k if self.a is None and r >= 2 else 0
        return ((1 + r) * (c + k * z) + tune) / (c + z)

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        if obs.model is None:
            raise ValueError(f"rmia needs a model in the observation (view {obs.view!r})")
        if obs.reference is None:
            raise ValueError("rmia needs reference models: obs.reference (a bench.reference.Reference) is None")
        items = list(candidates or [])
        if not items:
            raise ValueError("rmia needs candidates to score")
        steps = loss_timesteps(obs.api, self.timesteps)
        refs = obs.reference.models(self.n_reference)
        z = obs.reference.population(self.n_population)

        queries = queries_of(self.queries)
        # each query's items, built once and scored by the target and every reference model
        qx = [items if q == 0 else [augmented(x, query) for x in items] for q, query in enumerate(queries)]
        qz = [z if q == 0 else [augmented(x, query) for x in z] for q, query in enumerate(queries)]

        def losses(model, per_query: list[list[Any]], what: str) -> Tensor:  # [N, Q]
            return torch.stack(
                [self._losses(obs, model, xs, steps, what + (f" q{q}" if q else "")) for q, xs in enumerate(per_query)],
                1,
            )

        # every (model, items) pass as one loop, so a running cell reports how far it is (bench.progress)
        passes = [("candidates", obs.model, qx), ("z", obs.model, qz)]
        passes += [(f"ref{r} {w}", m, q) for w, q in (("candidates", qx), ("z", qz)) for r, m in enumerate(refs)]
        data, fixed = self._tuning(obs, refs)
        if data is not None:
            passes += [(f"tuning ref{r}", m, [data.members + data.nonmembers]) for r, m in enumerate(refs)]
        got = {w: losses(m, q, w) for w, m, q in progress(passes, desc="rmia passes", leave=False, unit=True)}
        lx, lz = got["candidates"], got["z"]
        lx_refs = torch.stack([got[f"ref{r} candidates"] for r in range(len(refs))], 1)  # [N, R, Q]
        lz_refs = torch.stack([got[f"ref{r} z"] for r in range(len(refs))], 1)
        p = lambda loss: torch.exp(-loss)  # noqa: E731 - p(x | theta), module doc
        if fixed is None:
            pt = p(torch.stack([got[f"tuning ref{r}"][:, 0] for r in range(len(refs))], 1))
            a, tuned = self._tuned_a(data, pt, p(lz_refs[..., 0]))
        else:
            a, tuned = fixed
        nq = range(len(queries))
        rmia = [
            rmia_scores(p(lx[:, q]), p(lx_refs[..., q]), p(lz[:, q]), p(lz_refs[..., q]), a=a, gamma=self.gamma)
            for q in nq
        ]
        lira = [
            lira_offline_scores(
                logit_from_loss(lx[:, q]), logit_from_loss(lx_refs[..., q]), global_variance=self.lira_global_variance
            )
            for q in nq
        ]
        scores = {
            "rmia": torch.stack(rmia).mean(0),
            "lira_offline": torch.stack(lira).mean(0),
            "neg_loss": -lx[:, 0],
        }
        details = {  # what the attacker was assumed to know and how it scored (the record's attack_details)
            "attacker_knowledge": obs.reference.knowledge(),
            "rmia": {"gamma": self.gamma, "a": a, "n_z": len(z), "a_from": tuned},
            "queries": [list(q) for q in queries] if len(queries) > 1 else "the candidate only",
            "lira_offline": {"global_variance": self.lira_global_variance or len(refs) < 2},
        }
        return Scores(scores, primary="rmia", details=details)

    def _losses(self, obs: Observation, model: Any, items: list[Any], steps: Any, what: str) -> Tensor:
        """[N] each item's mean loss under ``model``: seeded by the cell, shared through ``obs.signals``."""
        return cell_losses(obs, model, items, timesteps=steps, batch_size=self.batch_size, desc=f"rmia {what}").mean(1)

    def _tuning(self, obs: Observation, refs: list) -> tuple[Any, tuple[float, Any] | None]:
        """(reference 0's tuning members / non-members from bench.reference, None) when ``a`` is tuned; (None,
        (a, where it came from)) for the set ``a``, or :data:`UNTUNED_A` where there is nothing to tune on."""
        if self.a is not None:
            return None, (float(self.a), "set")
        data = obs.reference.tuning(len(refs), self.n_tune) if obs.reference is not None else None
        if data is None:
            return None, (UNTUNED_A, "not tuned (a base-model target or one reference model): the code's default")
        outs = data.out.any(1)
        if not outs[: len(data.members)].any() or not outs[len(data.members) :].any():
            return None, (
                UNTUNED_A,
                "not tuned (no member and non-member of reference 0 that another reference model did not train on: "
                "the population's training pool is too small): the code's default",
            )
        return data, None

    def _tuned_a(self, data: Any, pt: Tensor, pz_refs: Tensor) -> tuple[float, Any]:
        """(a, how) tuned on the reference models (:func:`tune_a`) from their signals ``pt`` [M, R] on ``data``'s
        items (members then non-members)."""
        member = torch.tensor([True] * len(data.members) + [False] * len(data.nonmembers))
        out = torch.from_numpy(data.out)
        a, aurocs = tune_a(pt, out, member, pz_refs, gamma=self.gamma)
        used = out.any(1)
        return a, {
            "tuned": "reference 0 attacked with the others (module doc)",
            "n_members": int(member[used].sum()),
            "n_nonmembers": int((~member[used]).sum()),
            "auroc_by_a": aurocs,
        }
