"""Image classifiers for the ``image-cls`` scenario: ViT and ResNet34 from timm ([FLRSP] s.4.1).

The scenario picks each model's shape per preset and passes it explicitly (:class:`ViTSize`,
:class:`ResNetSize`); this module never sees a preset name. Two kinds of model:
- randomly initialised (seeded) timm models of the given size: a ``VisionTransformer`` with a learnable
  positional embedding, class token and a Conv2d patch embedding, and a ``ResNet`` of BasicBlocks. The
  scenario's smoke models are tiny; its default models (a narrow ViT, a quarter-width ResNet34) are
  **pre-trained once** by :func:`load_or_pretrain` on public images disjoint from every member, non-member
  and test image (no pretrained ViT-S / ResNet34 weights install offline here). Measured on 1 thread:
  2.4 / 6.5 CPU-ms per training image (ViT / ResNet at 28 px) against 31+ for ViT-S/4 at 32 px, which made
  pre-training and over-fitting unaffordable.
- ``pretrained=True``: ``timm.create_model(arch, pretrained=True, num_classes=10)`` at 224 px with ImageNet
  weights (:data:`VIT_S16`, :data:`RESNET34`), pinned by hub id + revision and read from the local Hugging
  Face cache only (never downloaded).

For small inputs the ResNet's stem max-pool is removed (``ResNetSize.stem_pool=False``): at 32 px a stock
ResNet34 reaches layer4 at 1x1, where BatchNorm cannot take a batch-1 training step (the batch-1 client
update the reconstruction attacks target); without the pool layer4 is 2x2. The pretrained ResNet34 is
stock. Every builder is seeded: the same seed gives the same weights (the pretrained trunk plus a seeded
head).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.assets import AssetMissing, cache_dir, hub_missing
from bench.params import check_config, param
from bench.progress import progress

if TYPE_CHECKING:  # timm is imported where a model is built, so importing this module stays light
    from timm.models.resnet import ResNet
    from timm.models.vision_transformer import VisionTransformer

# (hub id, revision). The revision is the branch "main": no commit hash of these repositories could be
# verified offline; the commit actually loaded is resolved from the cache snapshot and recorded
# (``paper_weights``), so a run's provenance names it.
PAPER_WEIGHTS = {
    "vit": ("timm/vit_small_patch16_224.augreg_in21k_ft_in1k", "main"),
    "resnet34": ("timm/resnet34.a1_in1k", "main"),
}
ARCH_NAMES = {"vit": "vit_small_patch16_224", "resnet34": "resnet34"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# Per-channel normalisation of each architecture's pretrained weights (timm pretrained_cfg);
# used for every model size so the input space is the same whatever the weights.
NORMALISATION = {
    "vit": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "resnet34": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


@dataclass(frozen=True, kw_only=True)
class ViTSize:
    """The shape of a timm ``VisionTransformer``: patch side (px), token width, blocks, heads, MLP ratio."""

    patch: int = param(ge=1)
    width: int = param(ge=1)
    depth: int = param(ge=1)
    heads: int = param(ge=1)
    mlp_ratio: float = param(4.0, gt=0.0)

    def __post_init__(self) -> None:
        check_config(self, "ViT size")
        if self.width % self.heads:
            raise ValueError(f"ViT width {self.width} is not divisible by its {self.heads} heads")


@dataclass(frozen=True, kw_only=True)
class ResNetSize:
    """The shape of a timm BasicBlock ``ResNet``: blocks and channels per stage; ``stem_pool`` keeps the stem
    max-pool (module doc: removed for small inputs)."""

    layers: tuple[int, int, int, int] = param(ge=1)
    channels: tuple[int, int, int, int] = param(ge=1)
    stem_pool: bool = False

    def __post_init__(self) -> None:
        check_config(self, "ResNet size")
        if len(self.layers) != 4 or len(self.channels) != 4:
            raise ValueError(f"a ResNet has 4 stages: got layers {self.layers}, channels {self.channels}")


# the architectures of the pinned pretrained weights (PAPER_WEIGHTS); ``pretrained=True`` requires them
VIT_S16 = ViTSize(patch=16, width=384, depth=12, heads=6, mlp_ratio=4.0)
RESNET34 = ResNetSize(layers=(3, 4, 6, 3), channels=(64, 128, 256, 512), stem_pool=True)
PRETRAINED_IMG_SIZE = 224


def _check_pretrained(arch: str, size: ViTSize | ResNetSize, expected: ViTSize | ResNetSize, img_size: int) -> None:
    if size != expected:
        raise ValueError(f"the pretrained {ARCH_NAMES[arch]} has the shape {expected}, not {size}")
    if img_size != PRETRAINED_IMG_SIZE:
        raise ValueError(f"the pretrained {ARCH_NAMES[arch]} takes {PRETRAINED_IMG_SIZE} px inputs, not {img_size}")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE / HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "huggingface"
    )
    return Path(home) / "hub"


def paper_weights(arch: str) -> dict:
    """Locate the pinned pretrained weights in the local HF cache without any network access.

    Returns ``{"hub_id", "revision", "commit", "file"}``; raises AssetMissing at once when absent.
    """
    from huggingface_hub import try_to_load_from_cache

    hub_id, revision = PAPER_WEIGHTS[arch]
    cache = hf_hub_cache()
    for fname in WEIGHT_FILES:
        path = try_to_load_from_cache(hub_id, fname, cache_dir=str(cache), revision=revision)
        if isinstance(path, str) and Path(path).is_file():
            return {"hub_id": hub_id, "revision": revision, "commit": Path(path).parent.name, "file": path}
    raise hub_missing(hub_id, revision, what=f"{ARCH_NAMES[arch]} ImageNet weights (looked in {cache})")


def _pretrained(arch: str, *, num_classes: int, seed: int, **kwargs) -> nn.Module:
    import timm

    w = paper_weights(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the new 10-class head is the only randomly initialised part
        try:
            return timm.create_model(
                ARCH_NAMES[arch],
                pretrained=True,
                num_classes=num_classes,
                pretrained_cfg_overlay={"file": w["file"], "custom_load": False},
                **kwargs,
            )
        except (OSError, RuntimeError) as e:
            raise AssetMissing(f"could not load {w['hub_id']}@{w['revision']} from {w['file']}: {e}") from e


def vit(size: ViTSize, *, num_classes: int, img_size: int, seed: int, pretrained: bool = False) -> VisionTransformer:
    """ViT of ``size`` with a learnable positional embedding and a class token (the form APRIL attacks);
    ``pretrained``: the ImageNet ViT-S/16 weights (``size`` must be :data:`VIT_S16`, 224 px)."""
    if pretrained:
        _check_pretrained("vit", size, VIT_S16, img_size)
        return cast("VisionTransformer", _pretrained("vit", num_classes=num_classes, seed=seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(
            img_size=img_size,
            patch_size=size.patch,
            embed_dim=size.width,
            depth=size.depth,
            num_heads=size.heads,
            mlp_ratio=size.mlp_ratio,
            num_classes=num_classes,
        )


def resnet34(size: ResNetSize, *, num_classes: int, img_size: int, seed: int, pretrained: bool = False) -> ResNet:
    """A BasicBlock ResNet of ``size`` (ResNet34's is :data:`RESNET34`; see module doc on the stem);
    ``pretrained``: the ImageNet ResNet34 weights (``size`` must be :data:`RESNET34`, 224 px)."""
    if pretrained:
        _check_pretrained("resnet34", size, RESNET34, img_size)
        return cast("ResNet", _pretrained("resnet34", num_classes=num_classes, seed=seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from timm.models.resnet import BasicBlock, ResNet

        # timm annotates ``block`` as an instance type (BasicBlock | Bottleneck) but takes the class
        model = ResNet(
            block=BasicBlock,  # type: ignore[arg-type]
            layers=size.layers,
            channels=size.channels,
            num_classes=num_classes,
        )
    if not size.stem_pool:
        # small inputs: keep layer4 at >= 2x2 (module doc); timm types maxpool by its first value (Sequential)
        model.maxpool = nn.Identity()  # type: ignore[assignment]
    return model


# ----------------------------------------------------------------------------------------------
# supervised pre-training once on public data (the scenario's default models), cached as safetensors + JSON


@dataclass(frozen=True)
class PretrainConfig:
    """The recipe of a pre-trained base (AdamW, 10% warm-up then cosine decay, random
    batches with replacement from the public images); every field is part of the cache key."""

    steps: int = 150
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    seed: int = 0


def pretrain(model: nn.Module, images: Tensor, labels: Tensor, cfg: PretrainConfig) -> dict[str, Any]:
    """Fit ``model`` in place to (images [N,3,H,W] normalised, labels [N]); returns a small log."""
    if len(images) != len(labels) or len(images) == 0:
        raise ValueError(f"pre-training needs as many labels as images (got {len(images)} and {len(labels)})")
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, cfg.steps - warm))),
    )
    dev = next(model.parameters()).device
    model.train()
    t0, ema = time.time(), None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)  # dropout / stochastic depth, if any
        for _ in progress(range(cfg.steps), desc="image base pre-training", total=cfg.steps, leave=False):
            i = torch.randint(0, len(images), (cfg.batch_size,), generator=g)
            loss = F.cross_entropy(model(images[i].to(dev)), labels[i].to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            v = float(loss.detach())
            ema = v if ema is None else 0.95 * ema + 0.05 * v
    model.eval()
    return {"train_loss_ema": ema, "seconds": round(time.time() - t0, 1), "n_images": len(images)}


_BASES: dict[str, dict[str, Tensor]] = {}  # per process: cache key -> state (the file is read once)


def load_or_pretrain(
    build: Callable[[], nn.Module],
    cfg: PretrainConfig,
    spec: dict[str, Any],
    make_data: Callable[[], tuple[Tensor, Tensor]],
) -> tuple[dict[str, Tensor], str]:
    """The base state for (``spec``: the model and data identity, ``cfg``) from ``$BENCH_CACHE/image/<key>``
    (``base.json`` + ``base-<sha12>.safetensors`` via :mod:`bench.cachefile`: no pickle, checksummed), or
    pre-train ``build()`` on ``make_data()`` now (once per machine: a file lock serialises concurrent runs;
    a damaged entry is quarantined and rebuilt). Returns (state, key)."""
    import timm

    from bench import cachefile
    from bench.store import stable_hash

    key = stable_hash({"spec": spec, "pretrain": asdict(cfg), "timm": timm.__version__})
    if key in _BASES:
        return _BASES[key], key
    d = cache_dir("image", key)
    with cachefile.file_lock(d / "lock"):
        state = cachefile.load(d / "base", lambda tensors, meta: dict(tensors), quarantine_dir=d / "quarantine")
        if state is None:
            model = build()
            x, y = make_data()
            log = pretrain(model, x, y, cfg)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            cachefile.save(
                d / "base",
                state,
                {
                    "key": key,
                    "spec": spec,
                    "pretrain": asdict(cfg),
                    "log": log,
                    "timm": timm.__version__,
                    "torch": torch.__version__,
                },
            )
    _BASES[key] = state
    return state, key
