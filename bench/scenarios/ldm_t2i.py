"""Scenario ``ldm-t2i``: LoRA adaptation of a text-to-image latent diffusion model on private images, the
setting of [SMP-LoRA] (MP-LoRA / SMP-LoRA), also run federated by the LoRA defenses of the other papers.

Private data is split as [SMP-LoRA] Table 4: members D_tr = D_aux^m u D_te^m (what the LoRA is adapted
on), non-members D_aux^nm u D_te^nm, all drawn from one pool (so an attack on the un-adapted base model
sits at AUROC 0.5); D_aux = D_aux^m u D_aux^nm is the defender's proxy data (``task.extras``) and the
evaluation attacker's h' training set (App. E). Membership is evaluated on D_te^m vs D_te^nm only
(``task.eval_subsets``). A further held-out split gives the utility: held-out
denoising loss and FID / KID (EfficientNet-Lite0 features) of images generated from its captions. On smoke and
default the attacker also holds population images (``task.population``, :data:`N_POPULATION`) for reference models.

- ``smoke``: a tiny random-initialised VAE + UNet (32 px canvases, 8x8x4 latents), hashed bag-of-words
  text; 4 x 32 private images; seconds per training run.
- ``default``: a small VAE + UNet pre-trained once from scratch on a public split of Fashion-MNIST
  (the 60k training images; the private pool is the 10k test images, so the two are disjoint), cached
  by config hash; captions from :mod:`bench.captions`, encoded by all-MiniLM-L6-v2; 4 x 64 private images.
- ``paper``: Stable Diffusion v1.5 on the BLIP-captioned Pokemon images with Table 5's settings (rank 64,
  alpha 32, 512 px, batch 1, lr 1e-4, 400 epochs), 200/200/200/233 split (Table 4); local files only.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Subset

from bench import captions as cap
from bench.assets import AssetMissing
from bench.data import Items, fashion_mnist_for
from bench.fl import split_clients
from bench.progress import progress
from bench.registry import register_scenario
from bench.task import Task, preset_entry
from bench.types import DiffusionOps, DiffusionSpec, FLConfig, LoraSpec, TaskAPI
from bench.utility_gen import make_generation_utility, mean_loss
from models import ldm

PAPER_DATA_ENV = "BENCH_LDM_PAPER_DATA"
PAPER_DATA_REPO = "WilliamLUO0/StablePrivateLoRA"  # [SMP-LoRA]'s code; dataset/Pokemon/1_pokemon: 833 png + BLIP txt
PAPER_DATA_COMMIT = "c3182917b91862aa7883bddcd0570faaadb11833"


@dataclass(frozen=True)
class Spec:
    """What a preset pins (one entry of :data:`SPECS`, keyed by ``bench.task.PRESETS``)."""

    model: ldm.LDMConfig
    n_aux_m: int
    n_te_m: int
    n_aux_nm: int
    n_te_nm: int
    n_heldout: int
    fl: FLConfig
    central_epochs: int
    n_public: int = 0  # pre-training images (default preset)
    gen_steps: int = 20
    guidance: float = 2.0
    max_membership: int = 64
    data_seed: int = 0
    model_seed: int = 0
    notes: dict = field(default_factory=dict)
    model_label: str = ""  # task.config["model"]["model"] (a cache-key label; paper: the hub id instead)
    gpu_mem_mb: int | None = None  # Task.gpu_mem_mb: what one unit needs on a GPU (None: undeclared)


SPECS: dict[str, Spec] = {
    # Tiny model; its UNet is pre-trained for 160 steps on 512 public images (random VAE) so that it
    # denoises at all (a random UNet's LoRA barely memorises); cached. 6 epochs of 32 members = 24 steps.
    "smoke": Spec(
        model=ldm.LDMConfig(
            vae_channels=(8, 8, 16),
            unet_channels=(16, 32),
            text="hash",
            text_dim=32,
            text_len=12,
            lora_r=8,
            lora_alpha=8.0,
            unet_steps=160,
            unet_batch=16,
        ),
        n_aux_m=16,
        n_te_m=16,
        n_aux_nm=16,
        n_te_nm=16,
        n_heldout=16,
        n_public=512,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=2,
            local_epochs=3,
            batch_size=8,
            lr=5e-3,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=6,
        gen_steps=4,
        max_membership=16,
        model_label="tiny random LDM (diffusers AutoencoderKL + UNet2DConditionModel)",
    ),
    # Pre-trained base (see load_or_pretrain). Measured (seed 0, released LoRA, loss-threshold attack): 40 epochs
    # at alpha 4 left AUROC 0.53 (nothing for a defense to stop); 200 epochs at alpha 8 (scale 1) give 0.65 with
    # held-out denoising loss 0.032 vs 0.030 and the same FID (~135). Calibration for the positive control at
    # 256 + 256 D_te candidates (seed 0; loss threshold / proxy AUROC; base model 0.51 / 0.50), central LoRA:
    # rank 8, 200 epochs, lr 1e-3, batch 8: 0.624 / 0.646; lr 3e-3 0.605 / 0.603; batch 4 0.640 / 0.665; rank 32
    # (alpha 32) 0.661 / 0.672; 400 epochs 0.713 / 0.741; rank 32 at 500 epochs 0.778 / 0.811 [0.77, 0.85]
    # (chosen; held-out loss 0.035, FID 134; 1,116 s here beside a second process). FedAvg (the task's control
    # baseline; 4 clients x 64 members, all clients every round), rank 32: 125 rounds x 4 local epochs (the central
    # run's exposure) only 0.68-0.70 (averaging dilutes each client's fit); 250 x 4 0.79-0.83; 125 x 8 0.80-0.82
    # in both views (chosen: half the rounds; held-out loss 0.035, FID 131; 2,156 s here).
    "default": Spec(
        model=ldm.LDMConfig(
            vae_channels=(8, 16, 32),
            unet_channels=(32, 64),
            text="minilm",
            text_dim=384,
            text_len=16,
            lora_r=32,
            lora_alpha=32.0,
            vae_steps=300,
            vae_batch=32,
            unet_steps=1000,
            unet_batch=64,
        ),
        n_aux_m=64,
        n_te_m=256,
        n_aux_nm=64,
        n_te_nm=256,
        n_heldout=96,
        n_public=10000,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=125,
            local_epochs=8,
            batch_size=8,
            lr=1e-3,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=500,
        gen_steps=20,
        max_membership=256,
        model_label="small LDM pre-trained from scratch on public Fashion-MNIST",
    ),
    # [SMP-LoRA] Table 4 (Pokemon) and Table 5.
    # [SMP-LoRA] Appendix E (A100): on Pokemon, LoRA takes ~8,000 MiB of GPU memory and SMP-LoRA ~10,000 MiB.
    "paper": Spec(
        gpu_mem_mb=10_000,
        model=ldm.LDMConfig(image_size=512, text="clip", text_dim=768, text_len=77, lora_r=64, lora_alpha=32.0),
        n_aux_m=200,
        n_te_m=200,
        n_aux_nm=200,
        n_te_nm=233,
        n_heldout=0,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=100,
            local_epochs=4,
            batch_size=1,
            lr=1e-4,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=400,
        gen_steps=50,
        guidance=7.5,
        max_membership=200,
        notes={
            "lr_schedule": "constant (Table 5)",
            "proxy_lr_eta1": 1e-5,
            "utility": "FID/KID against D_te^nm images (no separate held-out split in Table 4)",
        },
    ),
}


# ----------------------------------------------------------------------------------------------
# Fashion-MNIST items with grounded captions


def _fashion():
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


def _private_pool(p: Spec) -> tuple[Any, dict[str, int], np.ndarray]:
    """The Fashion-MNIST test images (the private pool), the split sizes in order, and the seeded positions of
    the images they take (one permutation; consecutive slices are the splits)."""
    src = _fashion()
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
    src, sizes, perm = _private_pool(p)
    items = make_items(p.model, src.test_x[perm], src.test_y[perm], seed=p.data_seed, split=1)
    for it, idx in zip(items, perm):
        it["source_index"] = int(idx)
    out, start = {}, 0
    for name, n in sizes.items():
        out[name] = items[start : start + n]
        start += n
    return out


# Attacker-side population images per preset (reference models, [RMIA] / [LiRA]): Fashion-MNIST test images outside
# the private splits, rendered like them; half train the reference models (2x the members' count), half are RMIA's
# z samples (bench.reference). None on paper: Table 4's splits use all 833 Pokemon images. The training pool holds
# twice the central training set (D_aux^m + D_te^m), so reference training sets differ (tests/test_ldm.py).
N_POPULATION = {"smoke": 128, "default": 1280, "paper": 0}
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
    src, _, perm = _private_pool(p)
    idx = population_indices(len(src.test_x), perm, n, p.data_seed)
    items = make_items(p.model, src.test_x[idx], src.test_y[idx], seed=p.data_seed, split=POPULATION_SPLIT)
    for it, i in zip(items, idx):
        it["source_index"] = int(i)
    return items


def public_data(p: Spec) -> tuple[Tensor, Tensor, Tensor]:
    """The pre-training set: ``n_public`` Fashion-MNIST *training* images (disjoint from the private pool),
    augmented and captioned: (images [N,3,H,W] fp16, unique caption states [U,L,D] fp16, index [N])."""
    src = _fashion()
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


# ----------------------------------------------------------------------------------------------
# the task


def _base_factory(p: Spec):
    """A function returning a fresh copy of the (cached) base model; the base is built on first use."""
    holder: dict[str, ldm.LatentDiffusion] = {}

    def base() -> ldm.LatentDiffusion:
        if "m" not in holder:
            if p.model.vae_steps or p.model.unet_steps:
                res, path = ldm.load_or_pretrain(p.model, public_spec(p), lambda: public_data(p))
                holder["m"] = ldm.base_from(p.model, res)
                holder["log"] = res.log  # type: ignore[assignment]
            else:
                holder["m"] = ldm.random_base(p.model)
        return copy.deepcopy(holder["m"])

    base.holder = holder  # type: ignore[attr-defined]
    return base


def build_task(preset: str) -> Task:
    p = preset_entry(SPECS, preset)
    if preset == "paper":
        return _paper_task(p)
    splits = private_splits(p)
    make_base = _base_factory(p)
    return _assemble(
        "ldm-t2i",
        preset,
        p,
        splits,
        make_base,
        ldm.generate,
        _model_record(p),
        population=population_items(p, N_POPULATION[preset]),
    )


def _model_record(p: Spec) -> dict[str, Any]:
    """The model as ``Task.config`` records it on smoke / default."""
    return {
        "model": p.model_label,
        "text_encoder": "hashed bag of words" if p.model.text == "hash" else f"all-MiniLM-L6-v2 ({ldm.MINILM_PACKAGE})",
        "ldm": p.model.arch(),
        "pretrain_data": public_spec(p) if p.model.unet_steps else None,
        "private_pool": "fashion-mnist test split (10k)",
    }


def _assemble(
    name: str,
    preset: str,
    p: Spec,
    splits: dict[str, list[dict]],
    make_base,
    generate,
    model_cfg: dict[str, Any],
    n_blocks: int | None = None,
    population: list[dict] | None = None,
) -> Task:
    members = Items(splits["aux_members"] + splits["te_members"])
    nonmembers = Items(splits["aux_nonmembers"] + splits["te_nonmembers"])
    heldout = Items(splits["heldout"] or splits["te_nonmembers"])
    parts = split_clients(members.labels, p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed)
    client_data = [Subset(members, idx) for idx in parts]

    def build_model() -> nn.Module:
        """The base LDM with fresh LoRA on the UNet attention projections (B = 0: equals the base)."""
        return ldm.add_lora(
            make_base(), r=p.model.lora_r, alpha=p.model.lora_alpha, targets=p.model.lora_targets, seed=p.model_seed
        )

    n_blocks = _unet_blocks(p) if n_blocks is None else n_blocks
    diffusion = _diffusion_spec(p)
    api = TaskAPI(
        name=name,
        family="ldm-t2i",
        arch="unet",
        num_layers=n_blocks,
        lora=LoraSpec(r=p.model.lora_r, alpha=p.model.lora_alpha, targets=tuple(p.model.lora_targets)),
        diffusion=diffusion,
        aux_sets=True,
        diffusion_ops=DiffusionOps(
            loss_at_timestep=ldm.loss_at_timestep,
            loss_at_timesteps=ldm.loss_at_timesteps,
            denoise_error=ldm.denoise_error,
        ),
        loss=ldm.train_loss,
        per_sample_loss=ldm.per_sample_loss,
        collate=ldm.collate,
        build_model=build_model,
        logits=None,
        population_size=len(population or ()),
    )
    real = torch.stack([it["image"].float() for it in heldout.items])
    texts = torch.stack([it["text"].float() for it in heldout.items])
    utility = make_generation_utility(
        real,
        texts,
        generate=generate,
        steps=p.gen_steps,
        guidance=p.guidance,
        seed=p.data_seed,
        heldout_loss=mean_loss(ldm.per_sample_loss, ldm.collate, heldout.items, batch_size=32),
    )
    config = _assemble_config(p, model_cfg, {k: len(v) for k, v in splits.items()}, [len(c) for c in parts])
    extras = {
        "aux_members": list(splits["aux_members"]),
        "aux_nonmembers": list(splits["aux_nonmembers"]),
        "te_members": list(splits["te_members"]),
        "te_nonmembers": list(splits["te_nonmembers"]),
    }
    # membership is evaluated on D_te^m vs D_te^nm only ([SMP-LoRA] Table 4), never on D_aux, which the
    # MP-/SMP-LoRA proxy trained on; D_aux is the attacker's auxiliary split (its h', App. E)
    n_am, n_anm = len(splits["aux_members"]), len(splits["aux_nonmembers"])
    flat = [i for idx in parts for i in idx]  # member positions in the clients' concatenated data
    eval_subsets = {
        "central": list(range(n_am, len(members))),
        "clients": [j for j, i in enumerate(flat) if i >= n_am],
        "nonmembers": list(range(n_anm, len(nonmembers))),
    }
    return Task(
        scenario="ldm-t2i",
        variant="",
        preset=preset,
        api=api,
        fl=p.fl,
        client_data=client_data,
        test_data=heldout,
        utility=utility,
        nonmembers=nonmembers,
        central_data=members,
        central_epochs=p.central_epochs,
        max_membership=p.max_membership,
        extras=extras,
        config=config,
        eval_subsets=eval_subsets,
        population=Items(population) if population else None,
        gpu_mem_mb=p.gpu_mem_mb,
    )


def _assemble_config(
    p: Spec, model_cfg: dict[str, Any], sizes: dict[str, int], client_sizes: list[int]
) -> dict[str, Any]:
    """``Task.config``: the model record, the split sizes and the clients' sizes, with the preset's recipe."""
    return {
        **model_cfg,
        "splits": sizes,
        "client_sizes": client_sizes,
        "central_epochs": p.central_epochs,
        "lora": {"r": p.model.lora_r, "alpha": p.model.lora_alpha, "targets": list(p.model.lora_targets)},
        "eval_timesteps": _diffusion_spec(p).eval_timesteps,
        "gen_steps": p.gen_steps,
        "guidance": p.guidance,
        "data_seed": p.data_seed,
        "model_seed": p.model_seed,
        **p.notes,
    }


def _declared_config(preset: str) -> dict[str, Any]:
    """``Task.config`` on smoke / default from the labels and the split alone (nothing rendered or encoded, no
    model): what :func:`build_task` records, for planning a cached run (bench.specs)."""
    p = preset_entry(SPECS, preset)
    src, sizes, perm = _private_pool(p)
    labels = [int(y) for y in src.test_y[perm[: p.n_aux_m + p.n_te_m]]]
    parts = split_clients(labels, p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed)
    return _assemble_config(p, _model_record(p), sizes, [len(c) for c in parts])


# ----------------------------------------------------------------------------------------------
# paper preset: Stable Diffusion v1.5 + Pokemon BLIP captions, local files only


def _paper_images(folder: Path, size: int) -> tuple[list[Tensor], list[str]]:
    from PIL import Image

    pngs = sorted(q for q in folder.iterdir() if q.suffix.lower() in (".png", ".jpg", ".jpeg"))
    ims, caps = [], []
    for q in progress(pngs, desc="Pokemon images", leave=False):
        txt = q.with_suffix(".txt")
        if not txt.is_file():
            continue
        im = Image.open(q).convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        ims.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0)
        caps.append(txt.read_text().strip())
    return ims, caps


def _paper_task(p: Spec) -> Task:
    """The paper preset's task ([SMP-LoRA] Table 4): SD v1.5 with LoRA on the UNet's attention, the 833 Pokemon
    images split into D_aux / D_te members and non-members."""
    model, tok, text_model = ldm.load_sd15()  # AssetMissing at once when SD v1.5 is not cached
    folder = Path(os.environ.get(PAPER_DATA_ENV, ""))
    if not os.environ.get(PAPER_DATA_ENV) or not folder.is_dir():
        raise AssetMissing(
            f"the ldm-t2i paper preset needs the 833 BLIP-captioned Pokemon images (lambdalabs/pokemon-blip-captions) "
            f"as image + .txt caption pairs in a folder named by ${PAPER_DATA_ENV}; papers/004's code ships them: "
            f"`git clone https://github.com/{PAPER_DATA_REPO} && "
            f"git -C StablePrivateLoRA checkout {PAPER_DATA_COMMIT}` "
            f"then `export {PAPER_DATA_ENV}=$PWD/StablePrivateLoRA/dataset/Pokemon/1_pokemon`"
        )
    ims, caps = _paper_images(folder, p.model.image_size)
    need = p.n_aux_m + p.n_te_m + p.n_aux_nm + p.n_te_nm
    if len(ims) < need:
        raise ValueError(f"{folder} holds {len(ims)} captioned images, Table 4 needs {need}")
    with torch.no_grad():
        states = {}
        for i in range(0, len(caps), 32):
            t = tok(
                caps[i : i + 32],
                padding="max_length",
                max_length=tok.model_max_length,
                truncation=True,
                return_tensors="pt",
            )
            for c, s in zip(caps[i : i + 32], text_model(t.input_ids)[0]):
                states[c] = s.half()
    perm = np.random.default_rng(p.data_seed).permutation(len(ims))
    items = [
        {"image": ims[i].half(), "text": states[caps[i]], "caption": caps[i], "label": 0, "attrs": {}} for i in perm
    ]
    splits, start = {}, 0
    for name, n in (
        ("aux_members", p.n_aux_m),
        ("te_members", p.n_te_m),
        ("aux_nonmembers", p.n_aux_nm),
        ("te_nonmembers", p.n_te_nm),
    ):
        splits[name] = items[start : start + n]
        start += n
    splits["heldout"] = []
    return _assemble(
        "ldm-t2i",
        "paper",
        p,
        splits,
        lambda: copy.deepcopy(model),
        ldm.generate,
        {
            "model": ldm.SD15_ID,
            "model_revision": ldm.SD15_REVISION,
            "text_encoder": "SD v1.5 CLIP",
            "data": f"{PAPER_DATA_REPO}@{PAPER_DATA_COMMIT}:dataset/Pokemon/1_pokemon",
        },
        n_blocks=ldm.num_attention_blocks(model),
    )


def _unet_blocks(p: Spec) -> int:
    """Transformer blocks of the small UNet: lpb per down level, lpb + 1 per up level, one in the middle."""
    return len(p.model.unet_channels) * (2 * p.model.layers_per_block + 1) + 1


def _diffusion_spec(p: Spec) -> DiffusionSpec:
    return DiffusionSpec(
        num_timesteps=p.model.num_train_timesteps,
        image_size=p.model.image_size,
        eval_timesteps=tuple(ldm.eval_timesteps(p.model.num_train_timesteps)),
    )


# One-off preparation (bench.preparations): the default base's pre-training, measured at 1 thread beside two other
# processes (session 2026-12-01): 27 s to render and encode the public data, 326 s to pre-train (VAE 44 s, UNet
# 273 s; 336 s of CPU). Smoke's takes ~13 s and is not declared.
BASE_SECONDS = {"default": 355.0}


def preparations(preset: str) -> list:
    """The pre-trained base when the preset pre-trains one and it takes long (bench.preparations)."""
    from bench.preparations import Preparation

    p = preset_entry(SPECS, preset)
    seconds = BASE_SECONDS.get(preset)
    if seconds is None or not (p.model.vae_steps or p.model.unet_steps):
        return []
    stem = ldm.base_stem(p.model, public_spec(p), create=False)
    return [Preparation("ldm-t2i base pre-training", ("ldm-t2i",), stem, seconds)]


def specs(preset: str):
    """The task as ``bench list`` plans it, without rendering data or loading a model (bench.specs); None on
    ``paper`` (SD v1.5's blocks are counted on the loaded model) and when Fashion-MNIST is not installed."""
    from bench.specs import DeclaredTask, LazyConfig, fashion_mnist_installed
    from bench.types import TaskSpec

    p = preset_entry(SPECS, preset)
    if preset == "paper" or not fashion_mnist_installed():
        return None
    return [
        DeclaredTask(
            "ldm-t2i",
            TaskSpec(
                name="ldm-t2i",
                family="ldm-t2i",
                arch="unet",
                num_layers=_unet_blocks(p),
                lora=LoraSpec(r=p.model.lora_r, alpha=p.model.lora_alpha, targets=tuple(p.model.lora_targets)),
                diffusion=_diffusion_spec(p),
                aux_sets=True,
                population_size=N_POPULATION[preset],
            ),
            p.fl,
            config=LazyConfig(functools.partial(_declared_config, preset)),
        )
    ]


@register_scenario(name="ldm-t2i")
def build(preset: str) -> list[Task]:
    return [build_task(preset)]
