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

The presets' pinned values and their measurements are in :mod:`bench.scenarios._ldm_presets`, the data in
:mod:`bench.scenarios._ldm_data`; this module builds the task from them (the registry key is this file's name).
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Subset

from bench.assets import AssetMissing
from bench.data import Items
from bench.fl import split_clients
from bench.progress import progress
from bench.registry import register_scenario
from bench.scenarios._ldm_data import (
    POPULATION_SPLIT,
    make_items,
    population_indices,
    population_items,
    private_pool,
    private_splits,
    public_data,
    public_spec,
    render_items,
)
from bench.scenarios._ldm_presets import N_POPULATION, PAPER_DATA_COMMIT, PAPER_DATA_ENV, PAPER_DATA_REPO, SPECS, Spec
from bench.task import Task, preset_entry
from bench.types import DiffusionOps, DiffusionSpec, LoraSpec, TaskAPI
from bench.utility_gen import make_generation_utility, mean_loss
from models import ldm, ldm_base

__all__ = [  # the scenario's names, wherever they live (tests and users import them from here)
    "N_POPULATION",
    "PAPER_DATA_COMMIT",
    "PAPER_DATA_ENV",
    "PAPER_DATA_REPO",
    "POPULATION_SPLIT",
    "SPECS",
    "Items",
    "Spec",
    "build",
    "build_task",
    "make_items",
    "population_indices",
    "population_items",
    "preparations",
    "private_pool",
    "private_splits",
    "public_data",
    "public_spec",
    "render_items",
    "specs",
]


# ----------------------------------------------------------------------------------------------
# the task


def _base_factory(p: Spec):
    """A function returning a fresh copy of the (cached) base model; the base is built on first use."""
    holder: dict[str, ldm.LatentDiffusion] = {}

    def base() -> ldm.LatentDiffusion:
        if "m" not in holder:
            if p.model.vae_steps or p.model.unet_steps:
                res, path = ldm_base.load_or_pretrain(p.model, public_spec(p), lambda: public_data(p))
                holder["m"] = ldm_base.base_from(p.model, res)
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
            prepare=ldm.prepare_batch,
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
    src, sizes, perm = private_pool(p)
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
    stem = ldm_base.base_stem(p.model, public_spec(p), create=False)
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
