"""A scenario at a preset, instantiated: model builder, data, FL settings, utility.

A scenario module (``bench/scenarios/<name>.py``) registers a builder ``build(preset) -> list[Task]``
(several tasks when a scenario has model variants, e.g. ``image-cls/vit`` and ``image-cls/resnet34``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

from torch import nn
from torch.utils.data import Dataset

from .errors import UsageError
from .registry import unknown_message
from .types import FLConfig, TaskAPI

# The preset names, the one list of them (docs/design.md s.3). The CLI checks a user's preset with
# :func:`check_preset`; a scenario reads its own per-preset table with :func:`preset_entry` and hands models
# explicit sizes (``models/`` never sees a preset name).
PRESETS: tuple[str, ...] = ("smoke", "default", "paper")

E = TypeVar("E")


def check_preset(preset: str) -> str:
    """``preset`` itself when it is one of :data:`PRESETS`; else a UsageError naming the valid choices."""
    if preset not in PRESETS:
        raise UsageError(unknown_message("preset", preset, list(PRESETS)))
    return preset


def preset_entry(table: Mapping[str, E], preset: str) -> E:
    """A scenario's entry for ``preset`` in its per-preset ``table`` (checked against :data:`PRESETS`)."""
    check_preset(preset)
    if preset not in table:
        raise KeyError(f"the per-preset table has no entry for {preset!r} (it has {', '.join(table)})")
    return table[preset]


@dataclass
class Task:
    scenario: str
    variant: str
    preset: str
    api: TaskAPI
    fl: FLConfig
    client_data: Sequence[Dataset]
    test_data: Dataset
    utility: Callable[[nn.Module], dict[str, float]]
    nonmembers: Dataset | None = None  # held-out texts/images from the members' distribution
    recon_targets: Sequence[Any] | None = None  # (x, y) items the reconstruction probes send
    recon_ids: Sequence[str] | None = None  # stable ids of recon_targets, aligned (None: their positions, t:<i>)
    central_data: Dataset | None = None  # the released-model setting trains on this
    central_epochs: int = 1
    max_membership: int = 64  # candidates per side (members / non-members) for MIA cells
    extras: Mapping[str, Any] = field(default_factory=dict)  # defender-side data (e.g. D_aux^nm)
    # attacker-side population data of the members' distribution, disjoint from the members, the non-members
    # (evaluation and aux) and the test set: reference models train on it (bench.reference); not hashed into
    # ``config`` (training runs never see it); None = the scenario has none to spare
    population: Dataset | None = None
    config: Mapping[str, Any] = field(default_factory=dict)  # everything pinned, hashed for caching
    # membership evaluation restricted to these positions of each pool, the rest being the attacker's aux
    # split (ldm-t2i: [SMP-LoRA] evaluates on D_te only): keys "central" (central_data), "clients" (the
    # clients' data concatenated) and "nonmembers"; None = the whole pools (bench.cells.view_split)
    eval_subsets: Mapping[str, Sequence[int]] | None = None
    # a picklable zero-argument builder returning this task (or a list holding it): how a worker process
    # rebuilds the task (bench.units.TaskRef); set by the CLI, None = in-process runs only
    source: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    # GPU memory (MiB) the task's largest unit (a training run or a cell) needs, as its scenario declares it
    # (e.g. from the paper's report); None = undeclared. Workers sharing a GPU reserve it (bench.executors.SlotPool).
    gpu_mem_mb: int | None = None

    @property
    def id(self) -> str:
        return f"{self.scenario}/{self.variant}" if self.variant else self.scenario

    def shared_names(self, model: nn.Module) -> list[str]:
        """The trainable parameters: what the FL protocol may communicate."""
        return [n for n, p in model.named_parameters() if p.requires_grad]

    def config_hash(self) -> str:
        return config_hash(self.id, self.preset, self.fl, self.config)


def config_hash(task_id: str, preset: str, fl: FLConfig, config: Mapping[str, Any]) -> str:
    """The cache key of a task's configuration (``Task.config_hash``); bench.specs computes it from a scenario's
    declarations, without building the task."""
    fl_fields = dict(fl.__dict__)
    for key, default in (("lr_schedule", "constant"), ("batchnorm_stats", "batch")):
        if fl_fields.get(key) == default:  # added later: the default keeps the earlier keys (caches)
            del fl_fields[key]
    blob = json.dumps({"id": task_id, "preset": preset, "fl": fl_fields, **dict(config)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def subset_dataset(ds: Dataset, idx: Sequence[int]) -> Dataset:
    from torch.utils.data import Subset

    return Subset(ds, list(idx))
