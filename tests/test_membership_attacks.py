"""Membership attacks (max_renyi, loss_mia, gradient_mia) and the shared per-sample signals.

Unit checks against direct computations on hand-made distributions, then positive controls (a tiny
model over-fitted on its members is detected: AUROC >= 0.8) and negative controls (a model trained on
neither split, and a score that ignores the model, sit at AUROC 0.5 +- 0.1 with 200+ per side).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from attacks.gradient_mia import GradientMIA
from attacks.loss_mia import LossMIA, fit_attack_mlp
from attacks.max_renyi import MaxRenyi
from attacks.ref_loss import RefLoss
from bench.cells import best_threshold
from bench.loss_signals import loss_timesteps, per_sample_grad_norms
from bench.signals import _token_rows, masked_topk_mean, masked_topk_means, modified_renyi_entropy, renyi_entropy
from bench.types import DiffusionOps, DiffusionSpec, Observation, Public, TaskAPI
from tests.benchlib import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py: tiny models, one intra-op thread


def auroc(scores: torch.Tensor, n_members: int, n_nonmembers: int) -> float:
    return float(roc_auc_score([1] * n_members + [0] * n_nonmembers, scores.double().numpy()))


# ----------------------------------------------------------------------------------------------
# Rényi entropy, ModRényi, K% selection


P = [0.5, 0.25, 0.125, 0.0625, 0.0625]


def direct_renyi(p: list[float], alpha: float) -> float:
    if alpha == 1:
        return -sum(q * math.log(q) for q in p if q > 0)
    if math.isinf(alpha):
        return -math.log(max(p))
    return math.log(sum(q**alpha for q in p if q > 0)) / (1 - alpha)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, math.inf, 3.0])
def test_renyi_entropy_matches_direct_computation(alpha):
    logp = torch.tensor(P, dtype=torch.float64).log()
    assert renyi_entropy(logp, alpha).item() == pytest.approx(direct_renyi(P, alpha), rel=1e-10)


def test_renyi_entropy_closed_forms_and_limits():
    logp = torch.tensor(P, dtype=torch.float64).log()
    # hand values: H_1 = sum p log(1/p) = (0.5*1 + 0.25*2 + 0.125*3 + 2*0.0625*4) log 2, H_inf = log 2
    assert renyi_entropy(logp, 1.0).item() == pytest.approx(1.875 * math.log(2), rel=1e-12)
    assert renyi_entropy(logp, math.inf).item() == pytest.approx(math.log(2), rel=1e-12)
    assert renyi_entropy(logp, 2.0).item() == pytest.approx(-math.log(0.25 + 0.0625 + 0.015625 + 2 * 0.00390625))
    # alpha -> 1 gives Shannon, alpha -> inf gives the min-entropy
    assert renyi_entropy(logp, 1 + 1e-6).item() == pytest.approx(renyi_entropy(logp, 1.0).item(), abs=1e-5)
    assert renyi_entropy(logp, 1 - 1e-6).item() == pytest.approx(renyi_entropy(logp, 1.0).item(), abs=1e-5)
    assert renyi_entropy(logp, 2000.0).item() == pytest.approx(math.log(2), abs=1e-3)
    # non-increasing in alpha; uniform distribution: every order equals log V
    hs = [renyi_entropy(logp, a).item() for a in (0.5, 1.0, 2.0, math.inf)]
    assert all(a > b for a, b in zip(hs, hs[1:]))
    uni = torch.full((7,), 1 / 7).log()
    for a in (0.5, 1.0, 2.0, math.inf):
        assert renyi_entropy(uni, a).item() == pytest.approx(math.log(7), rel=1e-6)


def test_renyi_entropy_handles_zero_probabilities_and_batches():
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    h = renyi_entropy(p.log(), 1.0)
    assert torch.allclose(h, torch.tensor([math.log(2), 0.0], dtype=torch.float64))
    assert torch.allclose(renyi_entropy(p.log(), 0.5), torch.tensor([math.log(2), 0.0], dtype=torch.float64))


def direct_mod_renyi(p: list[float], y: int, alpha: float) -> float:
    py = p[y]
    if alpha == 1:
        return -(1 - py) * math.log(py) - sum(q * math.log(1 - q) for j, q in enumerate(p) if j != y)
    a = abs(1 - alpha)
    s = (1 - py) * py**a - (1 - py) + sum(q * (1 - q) ** a - q for j, q in enumerate(p) if j != y)
    return -s / a


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("y", [0, 3])
def test_modified_renyi_matches_direct_computation(alpha, y):
    logp = torch.tensor(P, dtype=torch.float64).log()
    got = modified_renyi_entropy(logp, torch.tensor(y), alpha).item()
    assert got == pytest.approx(direct_mod_renyi(P, y, alpha), rel=1e-9)
    near = modified_renyi_entropy(logp, torch.tensor(y), 1 + 1e-6).item()
    assert near == pytest.approx(direct_mod_renyi(P, y, 1.0), abs=1e-5)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # near-uniform, LM-like, very peaked next-token distributions
def test_fused_token_signals_equal_the_reference_functions(scale):
    """The few-pass per-token statistics (in-place softmax, dot products, ModRényi's series with exact
    large entries) equal renyi_entropy / modified_renyi_entropy computed in float64, to float32 precision,
    on a vocabulary wider than one block and not a multiple of it (the tail columns)."""
    g = torch.Generator().manual_seed(int(scale * 10))
    z = torch.randn(6, 1000, generator=g) * scale
    z[0, 7] += 30.0  # a near-certain prediction: p_y close to 1, ModRényi's tails tiny
    tgt = torch.randint(0, 1000, (6,), generator=g)
    tgt[0] = 7
    alphas, mods = (0.5, 1.0, 2.0, math.inf, 3.0), (0.5, 1.0, 2.0, 1.5, 3.0)
    got = _token_rows(z, tgt, alphas, mods)
    logp = torch.log_softmax(z.double(), -1)
    for a in alphas:
        assert torch.allclose(got[f"H{a}"].double(), renyi_entropy(logp, a), rtol=2e-5, atol=1e-6), a
    assert torch.allclose(got["logprob"].double(), logp.gather(-1, tgt[:, None])[:, 0], rtol=1e-5, atol=1e-6)
    for a in mods:
        want = modified_renyi_entropy(logp, tgt, a)
        assert torch.allclose(got[f"M{a}"].double(), want, rtol=2e-5, atol=1e-7), (a, got[f"M{a}"], want)


def test_topk_means_of_several_k_equal_one_k_at_a_time():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 9, generator=g)
    mask = torch.arange(9)[None] < torch.tensor([9, 4, 1, 6])[:, None]
    for largest in (True, False):
        many = masked_topk_means(values, mask, [0, 10, 33, 50, 100], largest=largest)
        for k, v in many.items():
            assert torch.allclose(v, masked_topk_mean(values, mask, k, largest=largest), rtol=1e-12)


def test_modified_entropy_is_lower_when_the_target_is_predicted():
    logp = torch.tensor(P, dtype=torch.float64).log()
    for a in (0.5, 1.0, 2.0):
        assert modified_renyi_entropy(logp, torch.tensor(0), a) < modified_renyi_entropy(logp, torch.tensor(4), a)


def test_masked_topk_mean_selects_k_percent_of_valid_positions():
    values = torch.tensor([[1.0, 5.0, 3.0, 2.0, 99.0], [4.0, -1.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, True, True, False], [True, True, False, False, False]])
    top = lambda k: masked_topk_mean(values, mask, k, largest=True).tolist()  # noqa: E731
    low = lambda k: masked_topk_mean(values, mask, k, largest=False).tolist()  # noqa: E731
    assert top(0) == [5.0, 4.0]  # K = 0: the maximum
    assert top(25) == [5.0, 4.0]  # floor(4 * 0.25) = 1; floor(2 * 0.25) = 0 -> at least 1
    assert top(50) == [4.0, 4.0]  # mean of (5, 3); one of two positions
    assert top(75) == pytest.approx([10 / 3, 4.0])  # floor(3.0) = 3; floor(1.5) = 1
    assert top(100) == [2.75, 1.5]  # the mean over valid positions
    assert low(0) == [1.0, -1.0]
    assert low(50) == [1.5, -1.0]
    with pytest.raises(ValueError, match="no token positions"):
        masked_topk_mean(values, torch.zeros_like(mask), 10, largest=True)


# ----------------------------------------------------------------------------------------------
# a hand-made "language model": max_renyi scores from fixed logits against direct computation


def _fixed_logits_api(table: torch.Tensor, targets: torch.Tensor, lengths: list[int]) -> TaskAPI:
    """Candidate i is the integer i; its logits / targets are rows of ``table`` / ``targets``."""

    def logits(model, batch, part):
        mask = torch.arange(table.shape[1]).unsqueeze(0) < torch.tensor([lengths[int(i)] for i in batch]).unsqueeze(1)
        if part == "image":
            return table[batch], None, mask
        return table[batch], targets[batch], mask

    return TaskAPI(
        name="fixed",
        family="vlm-caption",
        loss=lambda m, b: torch.zeros(()),
        per_sample_loss=lambda m, b: torch.zeros(len(b)),
        collate=lambda xs: torch.tensor(xs),
        build_model=nn.Identity,
        parts=("image", "caption"),
        logits=logits,
    )


def test_max_renyi_and_min_k_match_direct_computation_on_fixed_logits():
    g = torch.Generator().manual_seed(0)
    n, T, V = 5, 9, 11
    table = torch.randn(n, T, V, generator=g) * 2
    targets = torch.randint(0, V, (n, T), generator=g)
    lengths = [9, 4, 7, 1, 5]
    api = _fixed_logits_api(table, targets, lengths)
    attack = MaxRenyi(batch_size=2, chunk_rows=3)  # batch and chunk boundaries inside samples
    s = attack.run(Observation("global_model", nn.Identity(), None, api), list(range(n)))
    assert s.primary == "maxrenyi_K10_a0.5_caption"
    assert not any(k.startswith(("mink", "loss")) and k.endswith("_image") for k in s.scores)
    for i in range(n):
        probs = [torch.softmax(table[i, t].double(), -1).tolist() for t in range(lengths[i])]
        logpy = sorted(math.log(probs[t][int(targets[i, t])]) for t in range(lengths[i]))
        for alpha in (0.5, 1.0, 2.0, math.inf):
            ent = sorted((direct_renyi(p, alpha) for p in probs), reverse=True)
            for k in (0, 10, 30, 50, 100):
                m = max(1, (lengths[i] * k) // 100)
                want = -sum(ent[:m]) / m
                a = "inf" if math.isinf(alpha) else f"{alpha:g}"
                for part in ("image", "caption"):
                    assert s.scores[f"maxrenyi_K{k}_a{a}_{part}"][i].item() == pytest.approx(want, rel=1e-5)
        for k in (0, 20, 60):
            m = max(1, (lengths[i] * k) // 100)
            assert s.scores[f"mink_K{k}_caption"][i].item() == pytest.approx(sum(logpy[:m]) / m, rel=1e-5)
        assert s.scores["loss_caption"][i].item() == pytest.approx(sum(logpy) / len(logpy), rel=1e-5)
        want_mod = -np.mean([direct_mod_renyi(p, int(targets[i, t]), 2.0) for t, p in enumerate(probs)])
        assert s.scores["modrenyi_a2_caption"][i].item() == pytest.approx(want_mod, rel=1e-4)


def test_max_renyi_not_applicable_without_a_language_model_head():
    api = TaskAPI(
        name="cls",
        family="image-cls",
        loss=lambda m, b: None,
        per_sample_loss=lambda m, b: None,
        collate=list,
        build_model=nn.Identity,
    )
    assert MaxRenyi().applies(api) == "needs a language-model head (api.logits)"
    with pytest.raises(ValueError, match="primary"):
        MaxRenyi(primary_k=15)


# ----------------------------------------------------------------------------------------------
# a tiny language model on Markov-chain text


V, L, PREFIX = 32, 12, 4
_TRANSITIONS = torch.softmax(2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(7)), -1)


def markov_texts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, L, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,), generator=g)
    for t in range(1, L):
        x[:, t] = torch.multinomial(_TRANSITIONS[x[:, t - 1]], 1, generator=g).squeeze(1)
    return list(x)


class TinyLM(nn.Module):
    """Next-token logits from (position, token, previous token): enough capacity to memorise a few texts."""

    def __init__(self, h: int = 48):
        super().__init__()
        self.pos, self.tok, self.prev = nn.Embedding(L, h), nn.Embedding(V, h), nn.Embedding(V + 1, h)
        self.out = nn.Linear(h, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.full_like(x[:, :1], V), x[:, :-1]], 1)
        return self.out(torch.tanh(self.pos(torch.arange(x.shape[1])) + self.tok(x) + self.prev(prev)))


def lm_per_sample_loss(model, batch):
    logits = model(batch[:, :-1])
    nll = nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1), reduction="none")
    return nll.view(len(batch), -1).mean(1)


def lm_logits(model, batch, part):
    logits, targets = model(batch[:, :-1]), batch[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    if part == "prefix":  # a target-free slice, like the VLM's visual-token positions
        mask[:, : PREFIX - 1] = True
        return logits, None, mask
    mask[:, PREFIX - 1 :] = True
    return logits, targets, mask


LM_API = TaskAPI(
    name="tiny-lm",
    family="llm-text",
    loss=lambda m, b: lm_per_sample_loss(m, b).mean(),
    per_sample_loss=lm_per_sample_loss,
    collate=torch.stack,
    build_model=TinyLM,
    parts=("prefix", "text"),
    logits=lm_logits,
)


def train(model: nn.Module, loss_fn, data, *, steps: int, lr: float, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model, data).mean().backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def lm_setup():
    texts = markov_texts(16 * 4 + 2 * 200 + 48, seed=1)
    mem, aux_m, non, aux_n = texts[:16], texts[16:32], texts[32:48], texts[48:64]
    torch.manual_seed(0)
    overfit = train(TinyLM(), lm_per_sample_loss, torch.stack(mem + aux_m), steps=80, lr=3e-2)
    # negative control: trained (same recipe) on a third split, attacked on 200 + 200 unseen texts
    torch.manual_seed(1)
    neither = train(TinyLM(), lm_per_sample_loss, torch.stack(texts[-48:]), steps=80, lr=3e-2)
    return dict(
        mem=mem,
        aux_m=aux_m,
        non=non,
        aux_n=aux_n,
        overfit=overfit,
        neither=neither,
        cand_m=texts[64:264],
        cand_n=texts[264:464],
    )


def lm_obs(model, s, view="client_model"):
    return Observation(view, model, None, LM_API, Public(aux_members=s["aux_m"], aux_nonmembers=s["aux_n"]))


def test_max_renyi_positive_control_overfit_language_model(lm_setup):
    s = lm_setup
    scores = MaxRenyi().run(lm_obs(s["overfit"], s), s["mem"] + s["non"])
    assert scores.primary == "maxrenyi_K10_a0.5_text"
    for name in (
        scores.primary,
        "maxrenyi_K0_a0.5_text",
        "maxrenyi_K10_a2_text",
        "mink_K20_text",
        "loss_text",
        "modrenyi_a1_text",
    ):
        assert auroc(scores.scores[name], 16, 16) >= 0.8, name


def test_max_renyi_negative_control_model_trained_on_neither_split(lm_setup):
    s = lm_setup
    scores = MaxRenyi().run(lm_obs(s["neither"], s), s["cand_m"] + s["cand_n"])
    for name, v in scores.scores.items():
        assert abs(auroc(v, 200, 200) - 0.5) <= 0.1, name


def test_loss_mia_threshold_and_proxy_positive_control_language_model(lm_setup):
    s = lm_setup
    thr = LossMIA(method="threshold").run(lm_obs(s["overfit"], s), s["mem"] + s["non"])
    assert thr.primary == "neg_loss" and auroc(thr.scores["neg_loss"], 16, 16) >= 0.8
    prox = LossMIA(method="proxy", epochs=30).run(lm_obs(s["overfit"], s), s["mem"] + s["non"])
    assert prox.primary == "proxy" and auroc(prox.scores["proxy"], 16, 16) >= 0.8
    assert ((prox.scores["proxy"] >= 0) & (prox.scores["proxy"] <= 1)).all()


def test_loss_mia_proxy_needs_aux_data(lm_setup):
    s = lm_setup
    obs = Observation("global_model", s["overfit"], None, LM_API, Public(aux_members=s["aux_m"]))
    with pytest.raises(ValueError, match="aux_nonmembers"):
        LossMIA(method="proxy").run(obs, s["mem"])
    assert "neg_loss" in LossMIA(method="threshold").run(obs, s["mem"]).scores  # threshold needs none


# ----------------------------------------------------------------------------------------------
# a tiny classifier memorising random labels (loss / gradient attacks, vmap path)


D, C = 20, 4


def make_points(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g)
    return list(zip(x, y))


def collate_points(items):
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def build_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, C))


def mlp_per_sample_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="none")


CLS_API = TaskAPI(
    name="tiny-cls",
    family="image-cls",
    loss=lambda m, b: mlp_per_sample_loss(m, b).mean(),
    per_sample_loss=mlp_per_sample_loss,
    collate=collate_points,
    build_model=build_mlp,
)


@pytest.fixture(scope="module")
def cls_setup():
    pts = make_points(4 * 40 + 2 * 200 + 200, seed=3)
    mem, aux_m, non, aux_n = pts[:40], pts[40:80], pts[80:120], pts[120:160]
    torch.manual_seed(0)
    overfit = train(build_mlp(), mlp_per_sample_loss, collate_points(mem + aux_m), steps=300, lr=1e-2)
    torch.manual_seed(1)
    neither = train(build_mlp(), mlp_per_sample_loss, collate_points(pts[560:]), steps=300, lr=1e-2)
    return dict(
        mem=mem,
        aux_m=aux_m,
        non=non,
        aux_n=aux_n,
        overfit=overfit,
        neither=neither,
        cand_m=pts[160:360],
        cand_n=pts[360:560],
    )


def cls_obs(model, s, aux: int | None = None):
    return Observation(
        "released_model", model, None, CLS_API, Public(aux_members=s["aux_m"][:aux], aux_nonmembers=s["aux_n"][:aux])
    )


def test_loss_mia_positive_control_overfit_classifier(cls_setup):
    s = cls_setup
    for method in ("threshold", "proxy"):
        sc = LossMIA(method=method, epochs=30).run(cls_obs(s["overfit"], s), s["mem"] + s["non"])
        assert auroc(sc.scores[sc.primary], 40, 40) >= 0.8, method


def test_gradient_mia_positive_control_overfit_classifier(cls_setup):
    s = cls_setup
    sc = GradientMIA().run(cls_obs(s["overfit"], s), s["mem"] + s["non"])
    assert sc.primary == "gsa"
    assert auroc(sc.scores["gsa"], 40, 40) >= 0.8
    assert auroc(sc.scores["neg_grad_norm"], 40, 40) >= 0.8


def test_classifier_attacks_calibrate_their_asr_threshold_on_held_out_aux_scores(cls_setup):
    # arrange
    s = cls_setup
    attacks = {"proxy": LossMIA(method="proxy", epochs=30), "gsa": GradientMIA(n_estimators=50)}

    def bacc(sc, t, n):  # balanced accuracy of score >= t, the first n candidates members
        return 0.5 * ((sc[:n] >= t).double().mean() + (sc[n:] < t).double().mean()).item()

    for name, attack in attacks.items():
        # act
        pos = attack.run(cls_obs(s["overfit"], s), s["mem"] + s["non"])
        neg = attack.run(cls_obs(s["neither"], s), s["cand_m"] + s["cand_n"])

        # assert: every aux item has a held-out score; the threshold they give works on the overfit model
        # (positive control) and sits at chance where nothing was learned (negative control)
        cm, cn = pos.calibration[name]
        assert (len(cm), len(cn)) == (40, 40) and torch.isfinite(torch.cat([cm, cn])).all()
        assert bacc(pos.scores[name], best_threshold(cm.numpy(), cn.numpy()), 40) >= 0.7, name
        t_neg = best_threshold(*(v.numpy() for v in neg.calibration[name]))
        assert abs(bacc(neg.scores[name], t_neg, 200) - 0.5) <= 0.1, name


def test_loss_and_gradient_mia_negative_control_model_trained_on_neither_split(cls_setup):
    s = cls_setup
    obs = cls_obs(s["neither"], s)
    cands = s["cand_m"] + s["cand_n"]
    results = {
        "threshold": LossMIA(method="threshold").run(obs, cands),
        "proxy": LossMIA(method="proxy", epochs=30).run(obs, cands),
        "gsa": GradientMIA(n_estimators=50).run(obs, cands),
    }
    for what, sc in results.items():
        for name, v in sc.scores.items():
            assert abs(auroc(v, 200, 200) - 0.5) <= 0.1, (what, name)


def test_scores_that_ignore_the_model_are_at_chance(cls_setup):
    """Control for the evaluation itself: the strong loss score of the over-fitted model, shuffled so it no
    longer belongs to its candidate, is at chance; unshuffled on the same candidates it is not."""
    s = cls_setup
    cands = s["mem"] + s["aux_m"] + s["cand_n"][:80]  # 80 members (all trained on), 80 non-members
    sc = LossMIA().run(cls_obs(s["overfit"], s), cands).scores["neg_loss"]
    assert auroc(sc, 80, 80) >= 0.9
    shuffled = sc[torch.randperm(len(sc), generator=torch.Generator().manual_seed(0))]
    assert abs(auroc(shuffled, 80, 80) - 0.5) <= 0.1


def test_per_sample_gradient_norms_vmap_equals_loop(cls_setup):
    s = cls_setup
    items = s["mem"][:10] + s["non"][:7]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the vmap path must really run, not fall back to the loop
        fast, names = per_sample_grad_norms(CLS_API, s["overfit"], items, batch_size=4, use_vmap=True)
    slow, names2 = per_sample_grad_norms(CLS_API, s["overfit"], items, batch_size=4, use_vmap=False)
    assert names == names2 == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert fast.shape == (17, 4)
    assert torch.allclose(fast, slow, rtol=1e-4, atol=1e-7)
    # direct check for one sample
    m = s["overfit"]
    loss = mlp_per_sample_loss(m, collate_points(items[11:12]))[0]
    g = torch.autograd.grad(loss, list(m.parameters()))
    assert torch.allclose(slow[11], torch.stack([t.norm() for t in g]).double(), rtol=1e-5)


def test_gradient_features_fall_back_to_all_parameters_when_frozen(cls_setup):
    s = cls_setup
    m = build_mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    feats, names = per_sample_grad_norms(CLS_API, m, s["mem"][:3], use_vmap=False)
    assert len(names) == 4 and feats.shape == (3, 4) and (feats > 0).all()
    assert not any(p.requires_grad for p in m.parameters())  # restored
    m[0].weight.requires_grad_(True)  # only trainable tensors are features when there are some
    _, names = per_sample_grad_norms(CLS_API, m, s["mem"][:3])
    assert names == ["0.weight"]


# ----------------------------------------------------------------------------------------------
# the proxy attack model and the diffusion timestep hook


def test_proxy_mlp_learns_a_loss_gap():
    g = torch.Generator().manual_seed(0)
    am, an = torch.randn(64, 1, generator=g), torch.randn(64, 1, generator=g) + 2.0
    cm, cn = torch.randn(300, 1, generator=g), torch.randn(300, 1, generator=g) + 2.0
    predict = fit_attack_mlp(am, an, epochs=30, seed=0)
    # members have the lower loss: P(member) must decrease with the loss; the Bayes AUROC is ~0.92
    assert auroc(predict(torch.cat([cm, cn])), 300, 300) >= 0.85


def test_loss_timesteps_hook_gives_per_step_scores():
    seen = []

    def loss_at(model, batch, t):
        seen.append(t)
        return batch[:, 0] * (1 + t / 1000)

    api = TaskAPI(
        name="ldm",
        family="ldm-t2i",
        loss=lambda m, b: None,
        per_sample_loss=lambda m, b: b[:, 0],
        collate=torch.stack,
        build_model=nn.Identity,
        diffusion=DiffusionSpec(num_timesteps=1000, eval_timesteps=(), image_size=8),
        diffusion_ops=DiffusionOps(loss_at_timestep=loss_at, denoise_error=lambda m, b, *a: b[:, 0]),
    )
    assert loss_timesteps(api, 10) == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
    cands = [torch.tensor([v]) for v in (0.1, 0.5, 0.3)]
    sc = LossMIA(timesteps=4).run(Observation("released_model", nn.Identity(), None, api), cands)
    assert sorted(set(seen)) == [125, 375, 625, 875]
    assert set(sc.scores) == {"neg_loss", "neg_loss_t125", "neg_loss_t375", "neg_loss_t625", "neg_loss_t875"}
    want = -torch.tensor([0.1, 0.5, 0.3], dtype=torch.float64) * (1 + np.mean([125, 375, 625, 875]) / 1000)
    assert torch.allclose(sc.scores["neg_loss"], want)


# ----------------------------------------------------------------------------------------------
# ref_loss: the loss calibrated by the pre-trained base model's ([Watson], [Mireshghallah])


@pytest.fixture(scope="module")
def calibration_setup():
    """A base LM pre-trained on Markov text; candidates half Markov texts (easy for any model of the domain) and
    half uniform random tokens (hard): the uncalibrated loss mostly sees the difficulty."""
    import copy

    torch.manual_seed(0)
    base = train(TinyLM(), lm_per_sample_loss, torch.stack(markov_texts(400, seed=5)), steps=150, lr=3e-2)
    rand = list(torch.randint(0, V, (400, L), generator=torch.Generator().manual_seed(9)))
    easy = markov_texts(400, seed=11)
    mem, non = easy[:20] + rand[:20], easy[20:220] + rand[20:220]
    tuned = train(copy.deepcopy(base).train(), lm_per_sample_loss, torch.stack(mem), steps=5, lr=1e-2)
    other = markov_texts(20, seed=77) + rand[380:]  # fine-tuned on neither candidate split
    neither = train(copy.deepcopy(base).train(), lm_per_sample_loss, torch.stack(other), steps=5, lr=1e-2)
    return dict(base=base, mem=mem, non=non, tuned=tuned, neither=neither)


def ref_obs(model, base):
    import copy

    return Observation("global_model", model, None, LM_API, base_model=lambda: copy.deepcopy(base))


def test_ref_loss_positive_control_calibration_beats_the_plain_loss(calibration_setup):
    # arrange
    s = calibration_setup

    # act
    sc = RefLoss().run(ref_obs(s["tuned"], s["base"]), s["mem"] + s["non"])

    # assert: lightly fine-tuned, the plain loss barely separates; calibrated by the base model's it does
    got = {k: auroc(v, 40, 400) for k, v in sc.scores.items()}
    assert sc.primary == "calibrated" and set(got) == {"calibrated", "neg_ratio", "neg_loss"}
    assert got["calibrated"] >= 0.9 and got["neg_ratio"] >= 0.9, got
    assert got["calibrated"] >= got["neg_loss"] + 0.2, got


def test_ref_loss_negative_controls_base_target_and_unseen_candidates(calibration_setup):
    s = calibration_setup
    cands = s["mem"] + s["non"]
    on_base = RefLoss().run(ref_obs(s["base"], s["base"]), cands).scores["calibrated"]
    assert torch.equal(on_base, torch.zeros(len(cands), dtype=on_base.dtype))  # the leaderboard's base row: 0.5
    neither = RefLoss().run(ref_obs(s["neither"], s["base"]), cands)
    for name, v in neither.scores.items():
        assert abs(auroc(v, 40, 400) - 0.5) <= 0.12, name


def test_ref_loss_needs_the_base_model(calibration_setup):
    s = calibration_setup
    with pytest.raises(ValueError, match="base_model"):
        RefLoss().run(Observation("global_model", s["tuned"], None, LM_API), s["mem"])
