"""``image-cls``'s task functions (module level, so tasks pickle into worker processes): batching, losses,
the initial model (seeded random weights, or the cached pre-trained base: :class:`BaseSpec`), test
utility. The scenario (:mod:`bench.scenarios.image_cls`) builds its tasks from them."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bench import data as image_data
from bench.scenarios._image_presets import MODEL_SEED, SPECS
from models import image as image_models


def source(preset: str) -> image_data.ImageSource:
    """The preset's image source: CIFAR-10 for ``paper``, else Fashion-MNIST (or its offline fallbacks)."""
    return image_data.cifar10() if preset == "paper" else image_data.load_grayscale_source()


def collate(items: Sequence[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items], dtype=torch.long)


def _on_model(model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    dev = next(model.parameters()).device  # batches follow the model (bench.device)
    return batch[0].to(dev), batch[1].to(dev)


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = _on_model(model, batch)
    return F.cross_entropy(model(x), y)


def per_sample_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = _on_model(model, batch)
    return F.cross_entropy(model(x), y, reduction="none")


@dataclass(frozen=True)
class BaseSpec:
    """Where a task's pre-trained base comes from: ``indices`` into the source's training images."""

    source: str
    indices: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    cfg: image_models.PretrainConfig

    def key_spec(self, arch: str, preset: str, img_size: int, num_classes: int) -> dict[str, Any]:
        """The identity the cache is keyed by (with ``cfg``): model, data source and the exact images."""
        crc = zlib.crc32(np.asarray(self.indices, dtype=np.int64).tobytes())
        return {
            "arch": arch,
            "preset": preset,
            "img_size": img_size,
            "num_classes": num_classes,
            "model_seed": MODEL_SEED,
            "source": self.source,
            "n_images": len(self.indices),
            "indices_crc32": f"{crc:08x}",
            "mean": list(self.mean),
            "std": list(self.std),
        }


def _pretrain_data(preset: str, base: BaseSpec, img_size: int) -> tuple[Tensor, Tensor]:
    src = source(preset)
    if src.name != base.source:
        raise ValueError(f"the base was specified on {base.source}, but the data source now is {src.name}")
    idx = np.asarray(base.indices, dtype=np.int64)
    return (
        image_data.to_tensor(src.train_x[idx], img_size, base.mean, base.std),
        torch.from_numpy(src.train_y[idx].copy()),
    )


def build_model(arch: str, preset: str, img_size: int, num_classes: int, base: BaseSpec | None = None) -> nn.Module:
    """The task's initial model: seeded random weights, or (``base``) the cached pre-trained ones."""
    spec = SPECS[preset]
    sized: Callable[..., nn.Module] = (
        functools.partial(image_models.vit, spec.vit)
        if arch == "vit"
        else functools.partial(image_models.resnet34, spec.resnet)
    )
    make = functools.partial(
        sized, num_classes=num_classes, img_size=img_size, seed=MODEL_SEED, pretrained=spec.pretrained
    )
    model = make()
    if base is not None:
        state, _ = image_models.load_or_pretrain(
            make,
            base.cfg,
            base.key_spec(arch, preset, img_size, num_classes),
            functools.partial(_pretrain_data, preset, base, img_size),
        )
        model.load_state_dict(state)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256) -> dict[str, float]:
    """Test accuracy and mean cross-entropy of ``model`` on ``data`` (eval mode, restored after)."""
    was_training = model.training
    model.eval()
    correct, total_loss, n = 0, 0.0, 0
    try:
        for batch in DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collate):
            x, y = _on_model(model, batch)
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += len(y)
    finally:
        model.train(was_training)
    return {"accuracy": correct / max(n, 1), "test_loss": total_loss / max(n, 1)}
