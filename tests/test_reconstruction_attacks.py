"""Positive and negative controls for the reconstruction attacks (APRIL, inverting gradients).

The client is mimicked directly: a tiny timm model, a 32 px photo from scikit-image, cross-entropy,
batch 1, one gradient from torch.autograd (as bench.fl.batch_gradient computes it). SSIM is
scikit-image's on de-normalised images.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from skimage import data, transform
from skimage.metrics import structural_similarity
from timm.models.resnet import BasicBlock, ResNet
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.nn import functional as F

from attacks._client_update import infer_labels, total_variation, total_variation_grad, update_direction
from attacks._gradient_matching import Matcher
from attacks.april import April
from attacks.inverting_gradients import InvertingGradients
from bench.registry import ATTACKS
from bench.types import ImageSpec, Message, NotApplicable, Observation, Public, TaskAPI, ViTSpec
from tests.benchlib import one_thread  # noqa: F401 - the fixture

MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
SHAPE = (3, 32, 32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py: tiny models, one intra-op thread


# ----------------------------------------------------------------------------------------------
# fixtures: a photo, tiny models, a client's gradient, FLRSP's random zeros


def photo(name: str = "chelsea", size: int = 32) -> torch.Tensor:
    img = transform.resize(getattr(data, name)(), (size, size), anti_aliasing=True)
    x = torch.tensor(img, dtype=torch.float).permute(2, 0, 1)
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def ssim(rec: torch.Tensor, target: torch.Tensor) -> float:
    m, s = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    a = (rec * s + m).clamp(0, 1).numpy()
    b = (target * s + m).clamp(0, 1).numpy()
    return float(structural_similarity(a, b, channel_axis=0, data_range=1.0))


def tiny_vit(**kw) -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=4, embed_dim=96, depth=2, num_heads=3, num_classes=10, **kw)


def tiny_resnet() -> nn.Module:
    """A narrow timm BasicBlock ResNet (ResNet34's block and stem, one block per stage).

    At 32 px its last stage is 1x1, so train-mode BatchNorm cannot run on one image: the client
    computes its batch-1 gradient in eval mode (as Geiping et al.'s code does) and says so.
    """
    torch.manual_seed(0)
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=10, channels=(16, 32, 64, 128), zero_init_last=False)


def lenet() -> nn.Module:
    """The small sigmoid CNN of Deep Leakage from Gradients (Zhu et al. 2019): a fast control."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 12, 5, padding=2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2, stride=2),
        nn.Sigmoid(),
        nn.Conv2d(12, 12, 5, padding=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(12 * 8 * 8, 10),
    )


def bn_cnn() -> nn.Module:
    """A small conv net with train-mode BatchNorm: per-target batch statistics must stay per target."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def task_api(arch: str, build, **fields) -> TaskAPI:
    def loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    image = ImageSpec(input_shape=SHAPE, num_classes=10, mean=tuple(MEAN), std=tuple(STD))
    vit = (
        ViTSpec(pos_embed_param="pos_embed", patch_embed_param="patch_embed.proj.weight", patch_size=4)
        if arch == "vit"
        else None
    )
    fields = {"arch": arch, "image": image, "vit": vit, **fields}
    return TaskAPI(
        name=f"test-{arch}",
        family="image-cls",
        loss=loss,
        per_sample_loss=loss,
        collate=None,
        build_model=build,
        **fields,
    )


def client_gradient(model: nn.Module, x: torch.Tensor, y: int, *, train: bool = True) -> dict[str, torch.Tensor]:
    model.train(train)
    names = [n for n, _ in model.named_parameters()]
    loss = F.cross_entropy(model(x[None]), torch.tensor([y]))
    return {n: g.detach().clone() for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters())))}


def flrsp_mask(grads: dict[str, torch.Tensor], rate: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each entry zeroed with probability ``rate`` ([FLRSP] Eq. 6-7, the client side of FLRSP)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t * (torch.rand(t.shape, generator=g) >= rate) for n, t in grads.items()}


def observe(model, grads, api, kind="gradient", **public) -> Observation:
    msg = Message(client=0, round=0, tensors=grads, num_samples=1, kind=kind)
    return Observation("client_update", model, msg, api, Public(**{"num_samples": 1, **public}))


# ----------------------------------------------------------------------------------------------
# registry and contract


def test_both_attacks_are_registered_reconstruction_attacks_on_client_updates():
    for name in ("april", "inverting_gradients"):
        cls = ATTACKS.get(name)
        assert cls.views == ("client_update",) and cls.kind == "reconstruction"


def test_april_applies_only_to_vits_with_a_learnable_positional_embedding():
    assert April().applies(task_api("vit", tiny_vit)) is None
    assert "vision transformer" in April().applies(task_api("resnet34", tiny_resnet))
    assert "positional embedding" in April().applies(task_api("vit", tiny_vit, vit=None))


# ----------------------------------------------------------------------------------------------
# APRIL


def test_april_positive_control_recovers_the_image_of_an_undefended_vit():
    model, x = tiny_vit(), photo()
    api = task_api("vit", tiny_vit)
    rec = April().run(observe(model, client_gradient(model, x, 7), api))
    assert rec.images.shape == (1, *SHAPE)
    assert "failed" not in rec.details and not rec.details["underdetermined"]
    assert ssim(rec.images[0], x) >= 0.9
    assert rec.labels.tolist() == [7]


def test_april_positional_embedding_over_patches_only():
    build = lambda: tiny_vit(no_embed_class=True)  # noqa: E731  pos_embed has no class-token row
    model, x = build(), photo("astronaut")
    rec = April().run(observe(model, client_gradient(model, x, 2), task_api("vit", build)))
    assert rec.details["prefix_tokens"] == 0
    assert ssim(rec.images[0], x) >= 0.9


def test_april_recovers_from_a_one_step_fedavg_weights_message():
    model, x = tiny_vit(), photo()
    grads = client_gradient(model, x, 4)
    lr = 0.05
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = {n: glob[n] - lr * grads[n] for n in glob}
    obs = observe(model, weights, task_api("vit", tiny_vit), kind="weights", global_state=glob, lr=lr, local_steps=1)
    rec = April().run(obs)
    assert ssim(rec.images[0], x) >= 0.9 and rec.labels.tolist() == [4]


def test_april_negative_control_fixed_position_leaves_nothing_to_solve():
    model, x = tiny_vit(), photo()
    grads = client_gradient(model, x, 7)
    grads.pop("pos_embed")  # the fixed-position defense never sends it
    rec = April().run(observe(model, grads, task_api("vit", tiny_vit)))
    assert rec.details["failed"] == "no positional-embedding gradient"
    assert ssim(rec.images[0], x) < 0.3


def test_april_under_flrsp_random_zeros_loses_the_image():
    model, x = tiny_vit(), photo()
    grads = client_gradient(model, x, 7)
    clean = ssim(April().run(observe(model, grads, task_api("vit", tiny_vit))).images[0], x)
    masked = ssim(April().run(observe(model, flrsp_mask(grads, 0.8), task_api("vit", tiny_vit))).images[0], x)
    assert clean >= 0.9 and masked < 0.3


def test_april_refuses_batches_larger_than_one():
    model, x = tiny_vit(), photo()
    obs = observe(model, client_gradient(model, x, 1), task_api("vit", tiny_vit))
    obs = Observation(obs.view, obs.model, obs.message, obs.api, Public(num_samples=2))
    with pytest.raises(NotApplicable):
        April().run(obs)


# ----------------------------------------------------------------------------------------------
# label inference (iDLG)


@pytest.mark.parametrize("drop_bias", [False, True])
@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_label_inference_is_exact_for_batch_one(arch, drop_bias):
    build = tiny_vit if arch == "vit" else tiny_resnet
    model, x = build(), photo("astronaut")
    for y in (0, 3, 9):
        grads = client_gradient(model, x, y, train=arch == "vit")  # tiny_resnet: eval (1x1 last stage)
        if drop_bias:  # only the weight gradient: the rank-1 route
            grads = {n: g for n, g in grads.items() if n not in ("head.bias", "fc.bias")}
        labels, source = infer_labels(grads, model, 10, 1)
        assert labels.tolist() == [y], source
        assert ("bias" in source) != drop_bias


def test_label_inference_without_a_classifier_gradient_says_so():
    model = tiny_resnet()
    labels, source = infer_labels({}, model, 10, 1)
    assert labels.shape == (1,) and source.startswith("unavailable")


# ----------------------------------------------------------------------------------------------
# inverting gradients


def _bn_observations():
    model, x = bn_cnn(), photo()
    return model, x, client_gradient(model, x, 3), task_api("cnn", bn_cnn)


def test_inverting_gradients_batched_equals_one_target_at_a_time():
    """``run_batch`` gives each target the result it gets alone, not a mixture of targets
    (train-mode BatchNorm: each target keeps its own batch statistics)."""
    model, x, grads, api = _bn_observations()
    other = client_gradient(model, photo("astronaut"), 5)
    o1, o2 = observe(model, grads, api), observe(model, other, api)
    atk = InvertingGradients(iterations=5, signed=False, lr=0.01)
    joint = atk.run_batch([o1, o2])
    alone = [atk.run(o1), atk.run(o2)]
    assert joint[0].details["model_mode"] == "train"
    for j, a in zip(joint, alone):
        assert torch.allclose(j.images, a.images, atol=1e-4)
        assert j.labels.tolist() == a.labels.tolist()
    assert joint[0].labels.tolist() == [3] and joint[1].labels.tolist() == [5]
    assert not torch.allclose(joint[0].images, joint[1].images)


@pytest.mark.parametrize("similarity", ["global", "per_param", "sign"])
@pytest.mark.parametrize("masked", [False, True])
def test_gradient_matching_cotangents_equal_autograd(similarity, masked):
    """The closed-form derivative of the matching loss (one vector-Jacobian product per iteration) is
    autograd's, for the global and layer-wise cosine and the sign pairing, with and without FLRSP's zero mask."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 3)]
    g = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes]
    t = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    t[1] = torch.zeros(5, dtype=torch.float64)  # a withheld tensor: no say in the layer-wise cosine
    masks = [torch.rand(s, generator=gen) > 0.3 for s in shapes] if masked else None
    if masks is not None:
        t = [ti * mi for ti, mi in zip(t, masks)]
    match = Matcher(t, masks, similarity=similarity)
    loss = match(g)
    want = torch.autograd.grad(loss, g, allow_unused=True, materialize_grads=True)
    value, used, vs = match.cotangents(g)
    assert value.item() == pytest.approx(loss.item(), rel=1e-12)
    got = {id(u): v for u, v in zip(used, vs)}
    for gi, wi in zip(g, want):
        assert torch.allclose(got.get(id(gi), torch.zeros_like(gi)), wi, atol=1e-12)


def test_total_variation_gradient_in_closed_form_equals_autograd():
    """The TV term's gradient, added outside autograd each iteration, is autograd's (ties included:
    equal neighbours contribute nothing, as abs's subgradient 0 in torch)."""
    x = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 1, 2, :] = x[0, 1, 3, :]  # vertical ties
    x[1, 0, :, 1] = x[1, 0, :, 2]  # horizontal ties
    x.requires_grad_(True)
    (want,) = torch.autograd.grad(total_variation(x), x)
    got = total_variation_grad(x.detach())
    assert torch.allclose(got, want, atol=1e-15)


def test_inverting_gradients_start_follows_the_cell_seed():
    """The dummy's start is drawn from the cell seed (``obs.seed``): seeds vary the attack, a seed repeats it."""
    model, x, grads, api = _bn_observations()
    atk = InvertingGradients(iterations=2)
    obs = [observe(model, grads, api) for _ in range(3)]
    obs[1] = dataclasses.replace(obs[1], seed=1)
    a, b, c = (atk.run(o).images for o in obs)
    assert torch.equal(a, c) and not torch.allclose(a, b)


def test_inverting_gradients_matches_only_the_parameters_sent():
    model, x, grads, api = _bn_observations()
    sent = {n: g for n, g in grads.items() if not n.startswith("3.")}  # the second conv withheld
    rec = InvertingGradients(iterations=2).run(observe(model, sent, api))
    assert rec.details["matched_params"] == len(sent) < len(grads)
    assert rec.images.shape == (1, *SHAPE)


def test_inverting_gradients_stays_in_the_valid_pixel_box():
    model, x, grads, api = _bn_observations()
    rec = InvertingGradients(iterations=3, lr=1.0).run(observe(model, grads, api))
    lo, hi = (0 - MEAN[0]) / STD[0], (1 - MEAN[0]) / STD[0]
    assert rec.images.min() >= lo - 1e-6 and rec.images.max() <= hi + 1e-6


def test_inverting_gradients_unrolls_local_sgd_steps_of_a_weights_message():
    model, x, grads, api = _bn_observations()
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = {n: glob[n] - 0.01 * grads[n] for n in glob}
    obs = observe(model, weights, api, kind="weights", global_state=glob, lr=0.01, local_steps=2)
    rec = InvertingGradients(iterations=2).run(obs)
    assert rec.details["unrolled_steps"] == 2 and rec.details["message_kind"] == "weights"
    assert rec.labels.tolist() == [3]


def test_train_mode_batchnorm_with_one_value_per_channel_falls_back_to_eval():
    """The standard stem and stages leave 1x1 at 32 px: train-mode BatchNorm cannot run on one image."""

    def build():
        torch.manual_seed(0)
        return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=10, channels=(8, 8, 8, 8))

    model = build()
    x = torch.randn(3, 32, 32)
    grads = client_gradient(model, x, 1, train=False)
    rec = InvertingGradients(iterations=1, model_mode="train").run(observe(model, grads, task_api("resnet", build)))
    assert rec.details["model_mode"].startswith("eval")


def _inversion_controls(build, arch: str, iterations: int, model_mode: str = "auto") -> tuple[float, float, float]:
    """SSIM of (undefended inversion, FLRSP R=0.8 inversion, a random image) against the target (the
    client's gradient is taken in eval mode: pass ``model_mode="eval"`` for a model with BatchNorm)."""
    model, x = build(), photo("chelsea")
    grads = client_gradient(model, x, 3, train=False)
    api = task_api(arch, build)
    clean, masked = InvertingGradients(iterations=iterations, model_mode=model_mode).run_batch(
        [observe(model, grads, api), observe(model, flrsp_mask(grads, 0.8), api)]
    )
    assert clean.labels.tolist() == [3]
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).clamp(-2, 2)
    return ssim(clean.images[0], x), ssim(masked.images[0], x), ssim(noise, x)


def test_inverting_gradients_controls_fast_on_the_dlg_cnn():
    clean, masked, noise = _inversion_controls(lenet, "lenet", 100)
    assert clean > noise + 0.15, (clean, noise)
    assert clean > masked + 0.1, (clean, masked)


@pytest.mark.slow
def test_inverting_gradients_positive_control_on_an_undefended_resnet():
    """Undefended batch-1 gradient of a BasicBlock ResNet vs a random image and vs FLRSP R=0.8."""
    clean, masked, noise = _inversion_controls(tiny_resnet, "resnet34", 200, model_mode="eval")
    assert clean > noise + 0.15, (clean, noise)
    assert clean > masked + 0.1, (clean, masked)


def full_resnet34() -> nn.Module:
    """The ResNet34 the default preset trains (BasicBlock [3, 4, 6, 3] at a quarter of the width), as
    models.image builds it for small inputs (no max-pool)."""
    from bench.scenarios.image_cls import SPECS
    from models.image import resnet34

    return resnet34(SPECS["default"].resnet, num_classes=10, img_size=32, seed=0)


@pytest.mark.slow
def test_inverting_gradients_positive_control_on_the_full_resnet34():
    """The issue's control on the full architecture: undefended > random image and > FLRSP R=0.8."""
    clean, masked, noise = _inversion_controls(full_resnet34, "resnet34", 200, model_mode="eval")
    assert clean > noise + 0.1, (clean, noise)
    assert clean > masked + 0.05, (clean, masked)


def test_adaptive_mask_zeros_undoes_flrsp_against_inversion():
    """An attacker that ignores FLRSP's exact zeros (the server knows them: it averages non-zero
    entries only) matches the surviving 20% of the gradient and recovers the image again."""
    model, x = lenet(), photo("chelsea")
    obs = observe(model, flrsp_mask(client_gradient(model, x, 3, train=False), 0.8), task_api("lenet", lenet))
    naive, adaptive = (InvertingGradients(iterations=100, mask_zeros=m).run(obs) for m in (False, True))
    assert adaptive.details["mask_zeros"] and not naive.details["mask_zeros"]
    assert ssim(adaptive.images[0], x) > ssim(naive.images[0], x) + 0.1


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_one_step_adam_weights_message_holds_only_the_gradients_signs_and_the_record_says_so(optimizer):
    """One step of a fresh Adam moves each weight by ~lr * sign(g) (module doc): the update direction is the sign
    vector, and the attack notes it; a plain-SGD update is the gradient itself and gets no note."""
    model, x, grads, api = _bn_observations()
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = copy.deepcopy(model)
    opt = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer](client.parameters(), lr=0.01)
    for p, n in zip(client.parameters(), glob):
        p.grad = grads[n].clone()
    opt.step()
    weights = {n: p.detach().clone() for n, p in zip(glob, client.parameters())}
    obs = observe(model, weights, api, kind="weights", global_state=glob, lr=0.01, local_steps=1, optimizer=optimizer)

    direction, _ = update_direction(obs)
    rec = InvertingGradients(iterations=1).run(obs)

    d, g = (torch.cat([t[n].flatten() for n in glob]) for t in (direction, grads))
    want = g.sign() if optimizer == "adam" else g
    assert torch.nn.functional.cosine_similarity(d, want, dim=0) > 0.999
    assert ("sign(gradient)" in rec.details.get("note", "")) == (optimizer == "adam")
    assert rec.details["similarity"] == ("sign" if optimizer == "adam" else "global")


def test_the_sign_pairing_is_zero_exactly_at_the_targets_signs():
    """``similarity="sign"``: 1 - <g, t> / (|g|_1 |t|_inf) is 0 for any g with t's signs (an Adam client's
    one-step update holds nothing else) and positive when one sign differs."""
    gen = torch.Generator().manual_seed(0)
    t = [torch.randn(5, 3, generator=gen).sign(), torch.randn(4, generator=gen).sign()]
    match = Matcher(t, None, similarity="sign")
    g = [ti * (0.1 + torch.rand(ti.shape, generator=gen) * 3) for ti in t]
    assert float(match(g)) == pytest.approx(0.0, abs=1e-6)
    g[1][0] = -g[1][0]
    assert 0 < float(match(g)) <= 2


def test_on_an_adam_clients_one_step_update_the_sign_pairing_beats_the_cosine():
    """Positive control of ``similarity="sign"`` (chosen by "auto" for such a message): the true image is a minimum
    of the sign pairing but not of the cosine against a sign vector (whose cosine with the true gradient is
    |g|_1 / (|g|_2 sqrt(n)) < 1), so matching signs reconstructs the DLG CNN's image better."""
    model, x = lenet(), photo("chelsea")
    grads = client_gradient(model, x, 3, train=False)
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = {n: glob[n] - 0.01 * grads[n].sign() for n in glob}
    obs = observe(
        model,
        weights,
        task_api("lenet", lenet),
        kind="weights",
        global_state=glob,
        lr=0.01,
        local_steps=1,
        optimizer="adam",
    )
    auto, cosine = (InvertingGradients(iterations=100, similarity=s).run(obs) for s in ("auto", "global"))
    assert auto.details["similarity"] == "sign"
    assert ssim(auto.images[0], x) > ssim(cosine.images[0], x) + 0.04
