"""The ``paper`` preset of ``ldm-t2i``: [SMP-LoRA] Table 4's Stable Diffusion v1.5 with LoRA on the 833
BLIP-captioned Pokemon images, from local files only (:data:`bench.scenarios.ldm_t2i.PAPER_DATA_ENV`).

Kept apart from the scenario module (which builds the offline ``smoke`` / ``default`` tasks); imported only when
the paper preset is built.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bench.assets import AssetMissing
from bench.progress import progress
from bench.scenarios.ldm_t2i import PAPER_DATA_ENV, Spec, _assemble
from bench.task import Task
from models import ldm

PAPER_DATA_REPO = "WilliamLUO0/StablePrivateLoRA"  # [SMP-LoRA]'s code; dataset/Pokemon/1_pokemon: 833 png + BLIP txt
PAPER_DATA_COMMIT = "c3182917b91862aa7883bddcd0570faaadb11833"


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


def paper_task(p: Spec) -> Task:
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
