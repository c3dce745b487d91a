"""Image classifiers for the ``image-cls`` scenario: ViT-S/16 and ResNet34 from timm (papers/003 s.4.1).

Presets (DESIGN.md s.3):
- ``smoke``: tiny randomly initialised models of the same classes (a timm ``VisionTransformer`` with a
  learnable positional embedding, class token and a Conv2d patch embedding; a timm ``ResNet`` of
  BasicBlocks, one per stage, narrow).
- ``default``: the ViT-S/16 architecture (``vit_small_patch16_224``: dim 384, depth 12, 6 heads) with
  patch 4 for 32 px inputs, and the real ``resnet34`` at 32 px, both **randomly initialised**: no
  pretrained ViT-S / ResNet34 weights install offline on these machines.
- ``paper``: ``timm.create_model(arch, pretrained=True, num_classes=10)`` at 224 px with ImageNet weights,
  pinned by hub id + revision and read from the local Hugging Face cache only (never downloaded).

For small inputs (smoke / default) the ResNet's stem max-pool is removed: at 32 px a stock ResNet34
reaches layer4 at 1x1, where BatchNorm cannot take a batch-1 training step (the batch-1 client update
the reconstruction attacks target); without the pool layer4 is 2x2. The ``paper`` ResNet34 is stock.
Every builder is seeded: the same seed gives the same weights (the pretrained trunk plus a seeded head).
"""
from __future__ import annotations

import os
from pathlib import Path

import timm
import torch
from timm.models.resnet import BasicBlock, ResNet
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from bench.assets import AssetMissing, hub_missing

PRESETS = ("smoke", "default", "paper")

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
# used at every preset so the input space is the same whatever the weights.
NORMALISATION = {
    "vit": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "resnet34": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (HF_HUB_CACHE / HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                     "huggingface")
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
    w = paper_weights(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the new 10-class head is the only randomly initialised part
        try:
            return timm.create_model(ARCH_NAMES[arch], pretrained=True, num_classes=num_classes,
                                     pretrained_cfg_overlay={"file": w["file"], "custom_load": False}, **kwargs)
        except (OSError, RuntimeError) as e:
            raise AssetMissing(f"could not load {w['hub_id']}@{w['revision']} from {w['file']}: {e}") from e


def vit(preset: str, *, num_classes: int, img_size: int, seed: int) -> VisionTransformer:
    """ViT with a learnable positional embedding and a class token (the form APRIL attacks)."""
    _check_preset(preset)
    if preset == "paper":
        if img_size != 224:
            raise ValueError("the paper preset's vit_small_patch16_224 takes 224 px inputs")
        return _pretrained("vit", num_classes=num_classes, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if preset == "smoke":
            return VisionTransformer(img_size=img_size, patch_size=8, embed_dim=48, depth=2, num_heads=2,
                                     mlp_ratio=2.0, num_classes=num_classes)
        # ViT-S/16's architecture (dim 384, depth 12, 6 heads) with patch 4 for 32 px inputs
        return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=img_size, patch_size=4,
                                 num_classes=num_classes)


def vit_patch_size(preset: str) -> int:
    _check_preset(preset)
    return {"smoke": 8, "default": 4, "paper": 16}[preset]


def resnet34(preset: str, *, num_classes: int, img_size: int, seed: int) -> ResNet:
    """ResNet34 (BasicBlock [3,4,6,3]); smoke: one narrow BasicBlock per stage. See module doc on the stem."""
    _check_preset(preset)
    if preset == "paper":
        if img_size != 224:
            raise ValueError("the paper preset's resnet34 takes 224 px inputs")
        return _pretrained("resnet34", num_classes=num_classes, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if preset == "smoke":
            model = ResNet(block=BasicBlock, layers=(1, 1, 1, 1), channels=(16, 32, 64, 128), num_classes=num_classes)
        else:
            model = timm.create_model("resnet34", pretrained=False, num_classes=num_classes)
    model.maxpool = nn.Identity()  # small inputs: keep layer4 at >= 2x2 (module doc)
    return model
