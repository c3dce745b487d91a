"""A scenario at a preset, instantiated: model builder, data, FL settings, utility.

A scenario module (``bench/scenarios/<name>.py``) registers a builder ``build(preset) -> list[Task]``
(several tasks when a scenario has model variants, e.g. ``image-cls/vit`` and ``image-cls/resnet34``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from torch import nn
from torch.utils.data import Dataset

from .types import FLConfig, TaskAPI

PRESETS = ("smoke", "default", "paper")


@dataclass
class Task:
    scenario: str
    variant: str
    preset: str
    api: TaskAPI
    fl: FLConfig
    client_data: list[Dataset]
    test_data: Dataset
    utility: Callable[[nn.Module], dict[str, float]]
    nonmembers: Dataset | None = None  # held-out texts/images from the members' distribution
    recon_targets: Sequence[Any] | None = None  # (x, y) items the reconstruction probes send
    central_data: Dataset | None = None  # the released-model setting trains on this
    central_epochs: int = 1
    max_membership: int = 64  # candidates per side (members / non-members) for MIA cells
    extras: Mapping[str, Any] = field(default_factory=dict)  # defender-side data (e.g. D_aux^nm)
    config: Mapping[str, Any] = field(default_factory=dict)  # everything pinned, hashed for caching

    @property
    def id(self) -> str:
        return f"{self.scenario}/{self.variant}" if self.variant else self.scenario

    def shared_names(self, model: nn.Module) -> list[str]:
        """The trainable parameters: what the FL protocol may communicate."""
        return [n for n, p in model.named_parameters() if p.requires_grad]

    def config_hash(self) -> str:
        blob = json.dumps({"id": self.id, "preset": self.preset, "fl": self.fl.__dict__, **dict(self.config)},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def subset_dataset(ds: Dataset, idx: Sequence[int]) -> Dataset:
    from torch.utils.data import Subset

    return Subset(ds, list(idx))
