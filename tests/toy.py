"""A toy image-classification task, toy attacks and a hanging defense for harness tests (not registered globally)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from bench.fl import split_clients
from bench.task import Task
from bench.types import Attack, FLConfig, ImageSpec, Reconstructions, Scores, TaskAPI
from defenses.fedavg import FedAvg


def _collate(items):
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _per_sample(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 4))


def toy_task(n: int = 96, rounds: int = 2, seed: int = 0, lr: float = 0.05) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    items = list(zip(x, y.tolist()))
    train, non, test = items[: n // 2], items[n // 2 : 3 * n // 4], items[3 * n // 4 :]
    parts = split_clients([t[1] for t in train], 3, None, seed)
    api = TaskAPI(
        name="toy",
        family="image-cls",
        arch="mlp",
        loss=_loss,
        per_sample_loss=_per_sample,
        collate=_collate,
        build_model=_model,
        image=ImageSpec(input_shape=(3, 8, 8), num_classes=4, mean=(0.5,) * 3, std=(0.25,) * 3),
    )

    def utility(model):
        xb, yb = _collate(test)
        with torch.no_grad():
            return {"accuracy": float((model(xb).argmax(1) == yb).float().mean())}

    return Task(
        scenario="toy",
        variant="mlp",
        preset="smoke",
        api=api,
        fl=FLConfig(num_clients=3, clients_per_round=3, rounds=rounds, local_epochs=2, batch_size=8, lr=lr),
        client_data=[[train[i] for i in p] for p in parts],
        test_data=test,
        utility=utility,
        nonmembers=non,
        recon_targets=train[:2],
        max_membership=16,
        config={"n": n, "seed": seed},
    )


@dataclass
class ToyLossMIA(Attack):
    """Loss threshold: higher score for lower loss."""

    name = "toy_loss"
    views = ("global_model", "client_model", "released_model")
    kind = "membership"

    def run(self, obs, candidates):
        with torch.no_grad():
            neg = -obs.api.per_sample_loss(obs.model, obs.api.collate(candidates))
        return Scores({"neg_loss": neg, "neg_loss_x2": 2 * neg})


@dataclass
class ToyMeanRecon(Attack):
    """Returns a constant image: a reconstruction attack with nothing learned."""

    name = "toy_recon"
    views = ("client_update",)
    kind = "reconstruction"

    def run(self, obs, candidates):
        return Reconstructions(torch.zeros(1, *obs.api.image.input_shape))


@dataclass
class MarkThenHang(FedAvg):
    """A defense whose training leaves ``<tag>.<pid>`` in folder ``marks`` and hangs (shows which units started)."""

    name = "mark_then_hang"
    marks: str = ""
    tag: int = 0

    def client_step(self, state, ctx):
        Path(self.marks, f"{self.tag}.{os.getpid()}").write_text("")
        time.sleep(3600)
