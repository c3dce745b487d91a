"""The ldm-t2i scenario's data: Fashion-MNIST items augmented on a canvas and captioned from what they show
(:mod:`bench.captions`), each from its own seeded generator; the private splits of [SMP-LoRA] Table 4, the attacker's
population and the base model's public pre-training set."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench import captions as cap
from bench.data import fashion_mnist_for
from bench.scenarios._ldm_presets import Spec
from models import ldm


def fashion():
    return fashion_mnist_for("ldm-t2i")


def render_items(
    images: np.ndarray, labels: np.ndarray, *, seed: int, split: int, canvas: int
) -> tuple[list[Tensor], list[str], list[int], list[dict]]:
    """Augment each 28x28 image with its own generator (seed, split, index): deterministic per image."""
    ims, caps, labs, attrs = [], [], [], []
    for i in range(len(images)):
        rng = np.random.default_rng([seed, split, i])
        x, a = cap.augment(images[i], rng, canvas=canvas)
        ims.append(x)
        caps.append(cap.caption(cap.CLASS_NAMES[int(labels[i])], a))
        labs.append(int(labels[i]))
        attrs.append(a.as_dict())
    return ims, caps, labs, attrs


def make_items(cfg: ldm.LDMConfig, images: np.ndarray, labels: np.ndarray, *, seed: int, split: int) -> list[dict]:
    ims, caps, labs, attrs = render_items(images, labels, seed=seed, split=split, canvas=cfg.image_size)
    states = ldm.encode_captions(cfg, caps)
    return [
        {"image": x.half(), "text": states[c].half(), "caption": c, "label": y, "attrs": a}
        for x, c, y, a in zip(ims, caps, labs, attrs)
    ]


def private_pool(p: Spec) -> tuple[Any, dict[str, int], np.ndarray]:
    """The Fashion-MNIST test images (the private pool), the split sizes in order, and the seeded positions of
    the images they take (one permutation; consecutive slices are the splits)."""
    src = fashion()
    sizes = {
        "aux_members": p.n_aux_m,
        "te_members": p.n_te_m,
        "aux_nonmembers": p.n_aux_nm,
        "te_nonmembers": p.n_te_nm,
        "heldout": p.n_heldout,
    }
    need = sum(sizes.values())
    if need > len(src.test_x):
        raise ValueError(f"the private pool has {len(src.test_x)} images, the preset needs {need}")
    return src, sizes, np.random.default_rng(p.data_seed).permutation(len(src.test_x))[:need]


def private_splits(p: Spec) -> dict[str, list[dict]]:
    """D_aux^m, D_te^m, D_aux^nm, D_te^nm and the held-out set: disjoint slices of one permutation of the
    Fashion-MNIST test images (the private pool), rendered with per-image augmentations."""
    src, sizes, perm = private_pool(p)
    items = make_items(p.model, src.test_x[perm], src.test_y[perm], seed=p.data_seed, split=1)
    for it, idx in zip(items, perm):
        it["source_index"] = int(idx)
    out, start = {}, 0
    for name, n in sizes.items():
        out[name] = items[start : start + n]
        start += n
    return out


POPULATION_SPLIT = 2  # the population's augmentation stream (make_items ``split``): 0 public, 1 private


def population_indices(n_pool: int, taken: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Up to ``n`` positions in the private pool outside ``taken`` (the private splits' positions), in a
    seeded order of their own."""
    used = {int(i) for i in taken}
    order = np.random.default_rng([seed, 0x504F50]).permutation(n_pool).tolist()
    return np.asarray([i for i in order if i not in used][: max(n, 0)], dtype=np.int64)


def population_items(p: Spec, n: int) -> list[dict]:
    """Up to ``n`` Fashion-MNIST test images in none of the private splits (members, non-members, D_aux,
    held-out), augmented and captioned as the private pool is, from their own augmentation stream (the same
    distribution; no draw shared with a private item)."""
    if n <= 0:
        return []
    src, _, perm = private_pool(p)
    idx = population_indices(len(src.test_x), perm, n, p.data_seed)
    items = make_items(p.model, src.test_x[idx], src.test_y[idx], seed=p.data_seed, split=POPULATION_SPLIT)
    for it, i in zip(items, idx):
        it["source_index"] = int(i)
    return items


def public_data(p: Spec) -> tuple[Tensor, Tensor, Tensor]:
    """The pre-training set: ``n_public`` Fashion-MNIST *training* images (disjoint from the private pool),
    augmented and captioned: (images [N,3,H,W] fp16, unique caption states [U,L,D] fp16, index [N])."""
    src = fashion()
    idx = np.random.default_rng(p.data_seed + 1).permutation(len(src.train_x))[: p.n_public]
    ims, caps, _, _ = render_items(
        src.train_x[idx], src.train_y[idx], seed=p.data_seed, split=0, canvas=p.model.image_size
    )
    states = ldm.encode_captions(p.model, caps)
    unique = sorted(states)
    row = {c: i for i, c in enumerate(unique)}
    return (
        torch.stack(ims).half(),
        torch.stack([states[c] for c in unique]).half(),
        torch.tensor([row[c] for c in caps], dtype=torch.long),
    )


def public_spec(p: Spec) -> dict[str, Any]:
    return {
        "source": "fashion-mnist train (Debian dataset-fashion-mnist)",
        "n": p.n_public,
        "seed": p.data_seed,
        "captions": "bench.captions v1",
        "text": p.model.text,
    }
