"""Scenario ``image-cls``: federated image classification with ViT-S/16 and ResNet34 (papers/003 s.4.1).

Two tasks, ``image-cls/vit`` and ``image-cls/resnet34``, share the data and the split.
- ``smoke``: tiny random models, 4 clients, a few hundred Fashion-MNIST images at 32 px.
- ``default``: ViT-S/16 (patch 4) and ResNet34 at 32 px, randomly initialised, 5 IID clients on 400
  Fashion-MNIST images, 2 rounds of plain SGD, sized for 1-3 minutes per training run on an idle 2-core CPU (MNIST-5k / sklearn digits if the
  Debian package is missing; the source used is in ``task.config["data"]``).
- ``paper``: papers/003 Table 1: ImageNet-pretrained ``vit_small_patch16_224`` / ``resnet34`` at
  224 px on CIFAR-10, 5 clients x 10,000 images, batch 32, lr 1e-5 (ViT) / 1e-4 (ResNet), 10 epochs
  (FedAvg rounds), DP failure probability delta 0.5. The paper does not name the local optimiser;
  Adam is assumed. Its 10,000 test images are split (seeded) into 5,000 test and 5,000 non-members,
  because all 50,000 training images are members.

Items are ``(x: float Tensor[3,H,W] normalised with info["mean"/"std"], y: int)``. Members (client data),
non-members and test images are disjoint. Reconstruction targets mix scikit-image photos with client 0's
training images; photo ``i`` is labelled class ``i % num_classes`` (an arbitrary but valid label: the
photos are not from the class distribution, they make the picture grids legible).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from bench import data as D
from bench.assets import AssetMissing
from bench.fl import split_clients
from bench.registry import register_scenario
from bench.task import PRESETS, Task, subset_dataset
from bench.types import FLConfig, TaskAPI
from models import image as M

DATA_SEED = 0  # the data subset and the client split
MODEL_SEED = 0  # build_model: the same initial weights for every call of a task
VARIANTS = ("vit", "resnet34")


@dataclass(frozen=True)
class Spec:
    """What a preset pins besides the FL settings."""

    img_size: int
    n_train: int  # members, split over the clients
    n_test: int
    n_nonmembers: int
    n_photos: int  # reconstruction targets: scikit-image photos ...
    n_client_targets: int  # ... and client 0's training images
    max_membership: int
    dp_delta: float


SPECS = {
    "smoke": Spec(img_size=32, n_train=160, n_test=128, n_nonmembers=96, n_photos=2, n_client_targets=2,
                  max_membership=32, dp_delta=1e-5),
    "default": Spec(img_size=32, n_train=400, n_test=500, n_nonmembers=256, n_photos=4, n_client_targets=4,
                    max_membership=64, dp_delta=1e-5),
    "paper": Spec(img_size=224, n_train=50_000, n_test=5_000, n_nonmembers=5_000, n_photos=4, n_client_targets=11,
                  max_membership=500, dp_delta=0.5),
}


# Inverting-gradients iterations per preset: papers/003 runs 24,000; smoke/default fit a CPU budget. Measured
# on default (ViT-S/4 at 32 px, 8 targets optimised jointly, 1 thread on a loaded 2-core machine): ~2.8 s per
# iteration, so 1000 iterations were ~46 min per cell; 300 keep one cell near 10-15 min (the full ResNet34's
# positive control holds at 200, tests/test_reconstruction_attacks.py).
INVERSION_ITERATIONS = {"smoke": 60, "default": 300, "paper": 24_000}


def fl_config(preset: str, arch: str) -> FLConfig:
    """smoke / default train with plain SGD so that ``lr`` means the same in the FedAvg form (local SGD)
    and the FedSGD form (the server's step on the mean gradient). ``paper``: papers/003 Table 1."""
    if preset == "smoke":
        return FLConfig(num_clients=4, clients_per_round=4, rounds=2, local_epochs=1, batch_size=16, lr=0.05,
                        optimizer="sgd", mode="fedavg")
    if preset == "default":
        # measured (loaded 2-core CPU, FedAvg, 400 images x 2 rounds): ResNet34 ~0.2, ViT-S/4 ~0.3-0.4 CPU-s per
        # training image; lr chosen from a 50-step centralised sweep (ResNet34 SGD 0.05: 56% test acc.)
        return FLConfig(num_clients=5, clients_per_round=5, rounds=2, local_epochs=1, batch_size=16,
                        lr=0.03 if arch == "vit" else 0.05, optimizer="sgd", mode="fedavg")
    # papers/003 Table 1: 5 clients, batch 32, lr 1e-5 (ViT) / 1e-4 (ResNet), 10 epochs. The optimiser is not
    # named; Adam is assumed (those rates fine-tune pretrained models with Adam, not with plain SGD).
    return FLConfig(num_clients=5, clients_per_round=5, rounds=10, local_epochs=1, batch_size=32,
                    lr=1e-5 if arch == "vit" else 1e-4, optimizer="adam", mode="fedavg")


# ----------------------------------------------------------------------------------------------
# the task's public functions (module level so tasks pickle into worker processes)


def collate(items: Sequence[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items], dtype=torch.long)


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def per_sample_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def build_model(arch: str, preset: str, img_size: int, num_classes: int) -> nn.Module:
    fn = M.vit if arch == "vit" else M.resnet34
    return fn(preset, num_classes=num_classes, img_size=img_size, seed=MODEL_SEED)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256) -> dict[str, float]:
    """Test accuracy and mean cross-entropy of ``model`` on ``data`` (eval mode, restored after)."""
    was_training = model.training
    model.eval()
    correct, total_loss, n = 0, 0.0, 0
    try:
        for x, y in DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collate):
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            n += len(y)
    finally:
        model.train(was_training)
    return {"accuracy": correct / max(n, 1), "test_loss": total_loss / max(n, 1)}


# ----------------------------------------------------------------------------------------------
# data


def _source(preset: str) -> D.ImageSource:
    return D.cifar10() if preset == "paper" else D.load_grayscale_source()


def _indices(src: D.ImageSource, spec: Spec) -> dict[str, Any]:
    """Disjoint member / non-member / test indices; test from the official test split when there is one."""
    rng = np.random.default_rng(DATA_SEED)
    perm = rng.permutation(len(src.train_x))
    if src.test_x is None:  # one pool: members | non-members | test
        a, b = spec.n_train, spec.n_train + spec.n_nonmembers
        _need(src, b + spec.n_test, len(perm), "images")
        return {"train": perm[:a], "nonmembers": perm[a:b], "nonmembers_from": "train", "test": perm[b:b + spec.n_test]}
    tperm = rng.permutation(len(src.test_x))
    if spec.n_train >= len(perm):  # paper: every training image is a member; non-members from the test split
        _need(src, spec.n_train, len(perm), "training images")
        _need(src, spec.n_test + spec.n_nonmembers, len(tperm), "test images")
        return {"train": perm, "nonmembers": tperm[spec.n_test:spec.n_test + spec.n_nonmembers],
                "nonmembers_from": "test", "test": tperm[:spec.n_test]}
    _need(src, spec.n_train + spec.n_nonmembers, len(perm), "training images")
    _need(src, spec.n_test, len(tperm), "test images")
    return {"train": perm[:spec.n_train], "nonmembers": perm[spec.n_train:spec.n_train + spec.n_nonmembers],
            "nonmembers_from": "train", "test": tperm[:spec.n_test]}


def _need(src: D.ImageSource, n: int, have: int, what: str) -> None:
    if n > have:
        raise ValueError(f"{src.name} has {have} {what}; the preset needs {n}")


@dataclass
class _Data:
    clients: list[Dataset]
    client_idx: list[list[int]]  # per client: positions in the members' array
    test: Dataset
    nonmembers: Dataset
    targets: list[tuple[Tensor, int]]
    target_kinds: list[str]


def _datasets(src: D.ImageSource, idx: dict, spec: Spec, fl: FLConfig, mean, std) -> _Data:
    test_pool_x = src.test_x if src.test_x is not None else src.train_x
    test_pool_y = src.test_y if src.test_y is not None else src.train_y
    non_x = test_pool_x if idx["nonmembers_from"] == "test" else src.train_x
    non_y = test_pool_y if idx["nonmembers_from"] == "test" else src.train_y
    mk = functools.partial(D.ImageDataset, size=spec.img_size, mean=mean, std=std)
    members = mk(src.train_x[idx["train"]], src.train_y[idx["train"]])
    parts = split_clients(members.labels.tolist(), fl.num_clients, fl.dirichlet_alpha, seed=DATA_SEED)
    clients = [subset_dataset(members, p) for p in parts]
    test = mk(test_pool_x[idx["test"]], test_pool_y[idx["test"]])
    nonmembers = mk(non_x[idx["nonmembers"]], non_y[idx["nonmembers"]])
    num_classes = len(src.classes)
    names = D.PHOTOS[:spec.n_photos]
    photo_x = D.to_tensor(D.photos(names, spec.img_size), spec.img_size, mean, std) if names else []
    targets = [(photo_x[i], i % num_classes) for i in range(len(names))]
    kinds = [f"photo:{n}" for n in names]
    for j in range(min(spec.n_client_targets, len(clients[0]))):
        targets.append(clients[0][j])
        kinds.append(f"client0:{parts[0][j]}")
    return _Data(clients, parts, test, nonmembers, targets, kinds)


# ----------------------------------------------------------------------------------------------


@register_scenario(name="image-cls")
def build(preset: str) -> list[Task]:
    """The ``vit`` and ``resnet34`` tasks of ``image-cls`` at ``preset`` (module doc)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    spec = SPECS[preset]
    weights: dict[str, dict] = {}
    if preset == "paper":  # fail at once, naming every missing asset
        missing = []
        for arch in VARIANTS:
            try:
                weights[arch] = M.paper_weights(arch)
            except AssetMissing as e:
                missing.append(str(e))
        try:
            src = _source(preset)
        except AssetMissing as e:
            missing.append(str(e))
        if missing:
            raise AssetMissing("\n".join(missing))
    else:
        src = _source(preset)
    idx = _indices(src, spec)
    num_classes = len(src.classes)
    tasks = []
    for arch in VARIANTS:
        fl = fl_config(preset, arch)
        mean, std = M.NORMALISATION[arch]
        d = _datasets(src, idx, spec, fl, mean, std)
        info: dict[str, Any] = {"input_shape": (3, spec.img_size, spec.img_size), "num_classes": num_classes,
                                "classes": tuple(src.classes), "mean": list(mean), "std": list(std),
                                "arch": arch, "lora": False, "dp_delta": spec.dp_delta,
                                "inversion_iterations": INVERSION_ITERATIONS[preset]}
        if arch == "vit":
            info.update({"pos_embed_param": "pos_embed", "patch_embed_param": "patch_embed.proj.weight",
                         "patch_size": M.vit_patch_size(preset), "num_prefix_tokens": 1, "class_token": True})
        api = TaskAPI(name=f"image-cls/{arch}", family="image-cls", loss=loss, per_sample_loss=per_sample_loss,
                      collate=collate, info=info,
                      build_model=functools.partial(build_model, arch, preset, spec.img_size, num_classes))
        model_cfg: dict[str, Any] = {"arch": arch, "seed": MODEL_SEED, "builder": f"models.image.{arch}"}
        if preset == "paper":
            hub_id, rev = M.PAPER_WEIGHTS[arch]
            model_cfg.update({"pretrained": True, "hub_id": hub_id, "revision": rev, "commit": weights[arch]["commit"]})
        else:
            model_cfg.update({"pretrained": False, "stem_maxpool": False if arch == "resnet34" else None,
                              "patch_size": info.get("patch_size")})
        config = {
            "data": {"source": src.name, "origin": src.origin, "seed": DATA_SEED, "img_size": spec.img_size,
                     "n_train": len(idx["train"]), "n_test": len(idx["test"]), "n_nonmembers": len(idx["nonmembers"]),
                     "nonmembers_from": idx["nonmembers_from"], "client_sizes": [len(c) for c in d.clients],
                     "mean": list(mean), "std": list(std)},
            "model": model_cfg,
            "recon_targets": {"items": d.target_kinds, "labels": [int(y) for _, y in d.targets],
                              "photo_label_rule": "photo i -> class i % num_classes"},
            "max_membership": spec.max_membership, "dp_delta": spec.dp_delta,
        }
        tasks.append(Task(scenario="image-cls", variant=arch, preset=preset, api=api, fl=fl, client_data=d.clients,
                          test_data=d.test, utility=functools.partial(evaluate, data=d.test), nonmembers=d.nonmembers,
                          recon_targets=d.targets, max_membership=spec.max_membership, config=config))
    return tasks
