"""Scenario ``image-cls``: federated image classification with ViT-S/16 and ResNet34 ([FLRSP] s.4.1).

Two tasks, ``image-cls/vit`` and ``image-cls/resnet34``, share the data and the split.
- ``smoke``: tiny random models, 4 clients, a few hundred Fashion-MNIST images at 32 px.
- ``default``: a narrow ViT (patch 7, dim 128, depth 6) and a quarter-width ResNet34 at 28 px
  (``models.image``), both pre-trained once (cached under ``$BENCH_CACHE/image``, safetensors + JSON) on
  6,000 Fashion-MNIST training images disjoint from every member, non-member and test image; then
  federated fine-tuning of 2 IID clients x 156 members over 30 (ViT) / 40 (ResNet34) rounds x 3 epochs
  (cosine-decayed rate), so
  the undefended model over-fits its members (the positive control) while test accuracy stays >= 0.7
  (measurements at :func:`fl_config`). 600 non-members, 1,000 test images from the official test split. MNIST-5k /
  sklearn digits if the Debian package is missing (the source used is in ``task.config["data"]``).
- ``paper``: [FLRSP] Table 1: ImageNet-pretrained ``vit_small_patch16_224`` / ``resnet34`` at
  224 px on CIFAR-10, 5 clients x 10,000 images, batch 32, lr 1e-5 (ViT) / 1e-4 (ResNet), 10 epochs
  (FedAvg rounds), DP failure probability delta 0.5. The paper does not name the local optimiser;
  Adam is assumed. Its 10,000 test images are split (seeded) into 5,000 test and 5,000 non-members,
  because all 50,000 training images are members.

Items are ``(x: float Tensor[3,H,W] normalised with api.image.mean / std, y: int)``. Members (client data),
non-members and test images are disjoint. Reconstruction targets mix scikit-image photos with client 0's
training images; photo ``i`` is labelled class ``i % num_classes`` (an arbitrary but valid label: the
photos are not from the class distribution, they make the picture grids legible).

The presets' pinned values (:data:`SPECS`, :func:`fl_config`) and their measurements are in
:mod:`bench.scenarios._image_presets`, the task functions (losses, model, utility) in
:mod:`bench.scenarios._image_api`; this module builds the tasks (the registry key is this file's name).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from bench import data as image_data
from bench.assets import AssetMissing
from bench.fl import split_clients
from bench.registry import register_scenario
from bench.scenarios._image_api import (
    BaseSpec,
    build_model,
    collate,
    evaluate,
    loss,
    per_sample_loss,
    source,
)
from bench.scenarios._image_presets import (
    DATA_SEED,
    INVERSION_ITERATIONS,
    MODEL_SEED,
    SPECS,
    VARIANTS,
    Spec,
    fl_config,
)
from bench.task import Task, preset_entry, subset_dataset
from bench.types import FLConfig, ImageSpec, TaskAPI, ViTSpec, n_items
from models import image as image_models

__all__ = [  # the scenario's names, wherever they live (tests and users import them from here)
    "DATA_SEED",
    "INVERSION_ITERATIONS",
    "MODEL_SEED",
    "SPECS",
    "VARIANTS",
    "BaseSpec",
    "Spec",
    "build",
    "build_model",
    "collate",
    "evaluate",
    "fl_config",
    "loss",
    "per_sample_loss",
    "specs",
]

# ----------------------------------------------------------------------------------------------
# data


def _indices(src: image_data.ImageSource, spec: Spec) -> dict[str, Any]:
    """Disjoint member / non-member / test indices; test from the official test split when there is one."""
    rng = np.random.default_rng(DATA_SEED)
    perm = rng.permutation(len(src.train_x))
    pre = perm[len(perm) - spec.n_pretrain :] if spec.n_pretrain else perm[:0]  # the tail: public pre-training data
    if src.test_x is None:  # one pool: members | non-members | test | ... | pre-training
        a, b = spec.n_train, spec.n_train + spec.n_nonmembers
        _need(src, b + spec.n_test + spec.n_pretrain, len(perm), "images")
        return {
            "train": perm[:a],
            "nonmembers": perm[a:b],
            "nonmembers_from": "train",
            "test": perm[b : b + spec.n_test],
            "pretrain": pre,
        }
    tperm = rng.permutation(len(src.test_x))
    if spec.n_train >= len(perm):  # paper: every training image is a member; non-members from the test split
        _need(src, spec.n_train, len(perm), "training images")
        _need(src, spec.n_test + spec.n_nonmembers, len(tperm), "test images")
        if spec.n_pretrain:
            raise ValueError("pre-training needs training images that are not members")
        return {
            "train": perm,
            "nonmembers": tperm[spec.n_test : spec.n_test + spec.n_nonmembers],
            "nonmembers_from": "test",
            "test": tperm[: spec.n_test],
            "pretrain": pre,
        }
    _need(src, spec.n_train + spec.n_nonmembers + spec.n_pretrain, len(perm), "training images")
    _need(src, spec.n_test, len(tperm), "test images")
    return {
        "train": perm[: spec.n_train],
        "nonmembers": perm[spec.n_train : spec.n_train + spec.n_nonmembers],
        "nonmembers_from": "train",
        "test": tperm[: spec.n_test],
        "pretrain": pre,
    }


# Attacker-side population images per preset (reference models, [RMIA] / [LiRA]): training-split images in no
# other role; half train the reference models (>= n_train), half are RMIA's z samples (bench.reference).
N_POPULATION = {"smoke": 480, "default": 3000, "paper": 0}


def _population_indices(src: image_data.ImageSource, idx: dict, n: int) -> np.ndarray:
    """The first ``n`` training-split images of the data permutation that are no member, non-member, test or
    pre-training image (disjoint from every candidate of every cell)."""
    used = {int(i) for k in ("train", "pretrain") for i in idx[k]}
    if idx["nonmembers_from"] == "train":
        used.update(int(i) for i in idx["nonmembers"])
    if src.test_x is None:
        used.update(int(i) for i in idx["test"])
    perm = np.random.default_rng(DATA_SEED).permutation(len(src.train_x))
    return np.asarray([i for i in perm if int(i) not in used][:n], dtype=np.int64)


def _need(src: image_data.ImageSource, n: int, have: int, what: str) -> None:
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


def _datasets(src: image_data.ImageSource, idx: dict, spec: Spec, fl: FLConfig, mean, std) -> _Data:
    test_pool_x = src.test_x if src.test_x is not None else src.train_x
    test_pool_y = src.test_y if src.test_y is not None else src.train_y
    non_x = test_pool_x if idx["nonmembers_from"] == "test" else src.train_x
    non_y = test_pool_y if idx["nonmembers_from"] == "test" else src.train_y
    mk = functools.partial(image_data.ImageDataset, size=spec.img_size, mean=mean, std=std)
    members = mk(src.train_x[idx["train"]], src.train_y[idx["train"]])
    parts = split_clients(members.labels.tolist(), fl.num_clients, fl.dirichlet_alpha, seed=DATA_SEED)
    clients = [subset_dataset(members, p) for p in parts]
    test = mk(test_pool_x[idx["test"]], test_pool_y[idx["test"]])
    nonmembers = mk(non_x[idx["nonmembers"]], non_y[idx["nonmembers"]])
    num_classes = len(src.classes)
    names = image_data.PHOTOS[: spec.n_photos]
    photo_x: Tensor | list[Tensor] = []
    if names:
        photo_x = image_data.to_tensor(image_data.photos(names, spec.img_size), spec.img_size, mean, std)
    targets = [(photo_x[i], i % num_classes) for i in range(len(names))]
    kinds = [f"photo:{n}" for n in names]
    for j in range(min(spec.n_client_targets, n_items(clients[0]))):
        targets.append(clients[0][j])
        kinds.append(f"client0:{parts[0][j]}")
    return _Data(clients, parts, test, nonmembers, targets, kinds)


# ----------------------------------------------------------------------------------------------


def _model_config(
    arch: str,
    preset: str,
    spec: Spec,
    num_classes: int,
    vit: ViTSpec | None,
    base: BaseSpec | None,
    weights: dict | None,
) -> dict[str, Any]:
    """What ``Task.config["model"]`` records: the builder, and the pre-trained weights or base it starts from."""
    model_cfg: dict[str, Any] = {"arch": arch, "seed": MODEL_SEED, "builder": f"models.image.{arch}"}
    if spec.pretrained:
        assert weights is not None  # build() loads the paper weights first
        hub_id, rev = image_models.PAPER_WEIGHTS[arch]
        model_cfg.update({"pretrained": True, "hub_id": hub_id, "revision": rev, "commit": weights["commit"]})
    else:
        model_cfg.update(
            {
                "pretrained": base is not None,
                "stem_maxpool": False if arch == "resnet34" else None,
                "patch_size": vit.patch_size if vit is not None else None,
            }
        )
        if base is not None:  # the cache key's identity; the weights live in $BENCH_CACHE/image/<key>
            model_cfg["pretrain"] = {
                **base.key_spec(arch, preset, spec.img_size, num_classes),
                "images": "the last n_images of the data permutation (disjoint from members, non-members and test)",
                **asdict(base.cfg),
            }
    return model_cfg


def _base_spec(src: image_data.ImageSource, idx: dict, spec: Spec, arch: str) -> BaseSpec | None:
    """The pre-trained base's identity (default preset), None when the model starts from random weights."""
    if not (spec.n_pretrain and spec.pretrain is not None):
        return None
    mean, std = image_models.NORMALISATION[arch]
    return BaseSpec(src.name, tuple(int(i) for i in idx["pretrain"]), tuple(mean), tuple(std), spec.pretrain[arch])


def _task_config(
    src: image_data.ImageSource,
    idx: dict,
    spec: Spec,
    *,
    client_sizes: list[int],
    mean: Sequence[float],
    std: Sequence[float],
    model_cfg: dict[str, Any],
    target_kinds: list[str],
    target_labels: list[int],
) -> dict[str, Any]:
    """``Task.config``: everything pinned, hashed for caching (built here and in :func:`specs` alike)."""
    return {
        "data": {
            "source": src.name,
            "origin": src.origin,
            "seed": DATA_SEED,
            "img_size": spec.img_size,
            "n_train": len(idx["train"]),
            "n_test": len(idx["test"]),
            "n_nonmembers": len(idx["nonmembers"]),
            "n_pretrain": len(idx["pretrain"]),
            "nonmembers_from": idx["nonmembers_from"],
            "client_sizes": client_sizes,
            "mean": list(mean),
            "std": list(std),
        },
        "model": model_cfg,
        "recon_targets": {
            "items": target_kinds,
            "labels": target_labels,
            "photo_label_rule": "photo i -> class i % num_classes",
        },
        "max_membership": spec.max_membership,
        "dp_delta": spec.dp_delta,
    }


def _declared_config(preset: str, arch: str) -> dict[str, Any]:
    """``Task.config`` of ``image-cls/<arch>`` from the labels and the split alone (no image converted, no photo
    read, no model): what :func:`build` records, for planning a cached run (bench.specs)."""
    spec = preset_entry(SPECS, preset)
    src = source(preset)
    idx = _indices(src, spec)
    fl = fl_config(preset, arch)
    mean, std = image_models.NORMALISATION[arch]
    member_labels = np.asarray(src.train_y[idx["train"]], dtype=np.int64)
    parts = split_clients(member_labels.tolist(), fl.num_clients, fl.dirichlet_alpha, seed=DATA_SEED)
    names = image_data.PHOTOS[: spec.n_photos]
    firsts = [parts[0][j] for j in range(min(spec.n_client_targets, len(parts[0])))]
    return _task_config(
        src,
        idx,
        spec,
        client_sizes=[len(p) for p in parts],
        mean=mean,
        std=std,
        model_cfg=_model_config(
            arch, preset, spec, len(src.classes), _vit_spec(preset, arch), _base_spec(src, idx, spec, arch), None
        ),
        target_kinds=[f"photo:{n}" for n in names] + [f"client0:{i}" for i in firsts],
        target_labels=[i % len(src.classes) for i in range(len(names))] + [int(member_labels[i]) for i in firsts],
    )


def _image_spec(preset: str, arch: str, classes: tuple[str, ...]) -> ImageSpec:
    spec = SPECS[preset]
    mean, std = image_models.NORMALISATION[arch]
    return ImageSpec(
        input_shape=(3, spec.img_size, spec.img_size),
        num_classes=len(classes),
        classes=classes,
        mean=tuple(mean),
        std=tuple(std),
        inversion_iterations=INVERSION_ITERATIONS[preset],
    )


def _vit_spec(preset: str, arch: str) -> ViTSpec | None:
    return (
        ViTSpec(
            pos_embed_param="pos_embed",
            patch_embed_param="patch_embed.proj.weight",
            patch_size=SPECS[preset].vit.patch,
            num_prefix_tokens=1,
            class_token=True,
        )
        if arch == "vit"
        else None
    )


def specs(preset: str):
    """The tasks as ``bench list`` plans them, without loading data (bench.specs): Fashion-MNIST's classes and
    the preset's population size. None on ``paper`` (building checks its weights and CIFAR-10) and when
    Fashion-MNIST is not installed (building falls back to another source then)."""
    from bench.data import FASHION_MNIST_CLASSES
    from bench.specs import DeclaredTask, LazyConfig, fashion_mnist_installed
    from bench.types import TaskSpec

    spec = preset_entry(SPECS, preset)
    if spec.pretrained or not fashion_mnist_installed():
        return None
    return [
        DeclaredTask(
            f"image-cls/{arch}",
            TaskSpec(
                name=f"image-cls/{arch}",
                family="image-cls",
                arch=arch,
                image=_image_spec(preset, arch, FASHION_MNIST_CLASSES),
                vit=_vit_spec(preset, arch),
                dp_delta=spec.dp_delta,
                population_size=N_POPULATION[preset],
            ),
            fl_config(preset, arch),
            config=LazyConfig(functools.partial(_declared_config, preset, arch)),
        )
        for arch in VARIANTS
    ]


@register_scenario(name="image-cls")
def build(preset: str) -> list[Task]:
    """The ``vit`` and ``resnet34`` tasks of ``image-cls`` at ``preset`` (module doc)."""
    spec = preset_entry(SPECS, preset)
    weights: dict[str, dict] = {}
    if spec.pretrained:  # fail at once, naming every missing asset (the weights and the paper data)
        missing = []
        for arch in VARIANTS:
            try:
                weights[arch] = image_models.paper_weights(arch)
            except AssetMissing as e:
                missing.append(str(e))
        try:
            src = source(preset)
        except AssetMissing as e:
            missing.append(str(e))
        if missing:
            raise AssetMissing("\n".join(missing))
    else:
        src = source(preset)
    idx = _indices(src, spec)
    pop_idx = _population_indices(src, idx, N_POPULATION[preset])
    num_classes = len(src.classes)
    tasks = []
    for arch in VARIANTS:
        fl = fl_config(preset, arch)
        mean, std = image_models.NORMALISATION[arch]
        d = _datasets(src, idx, spec, fl, mean, std)
        base = _base_spec(src, idx, spec, arch)
        image, vit = _image_spec(preset, arch, tuple(src.classes)), _vit_spec(preset, arch)
        api = TaskAPI(
            name=f"image-cls/{arch}",
            family="image-cls",
            arch=arch,
            image=image,
            vit=vit,
            dp_delta=spec.dp_delta,
            population_size=len(pop_idx),
            loss=loss,
            per_sample_loss=per_sample_loss,
            collate=collate,
            build_model=functools.partial(build_model, arch, preset, spec.img_size, num_classes, base),
        )
        model_cfg = _model_config(arch, preset, spec, num_classes, vit, base, weights.get(arch))
        config = _task_config(
            src,
            idx,
            spec,
            client_sizes=[n_items(c) for c in d.clients],
            mean=mean,
            std=std,
            model_cfg=model_cfg,
            target_kinds=d.target_kinds,
            target_labels=[int(y) for _, y in d.targets],
        )
        tasks.append(
            Task(
                scenario="image-cls",
                variant=arch,
                preset=preset,
                api=api,
                fl=fl,
                client_data=d.clients,
                test_data=d.test,
                utility=functools.partial(evaluate, data=d.test),
                nonmembers=d.nonmembers,
                recon_targets=d.targets,
                recon_ids=d.target_kinds,  # photo:<name> / client0:<index in the members' array>
                max_membership=spec.max_membership,
                config=config,
                population=image_data.ImageDataset(
                    src.train_x[pop_idx], src.train_y[pop_idx], size=spec.img_size, mean=mean, std=std
                )
                if len(pop_idx)
                else None,
            )
        )
    return tasks
