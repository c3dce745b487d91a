"""The vlm-caption ``paper`` preset: [FedRand]'s TinyLLaVA-OpenELM-450M-CLIP-0.55B on MSCOCO (Karpathy split),
from local files only (the model from the Hugging Face cache, the images from ``$BENCH_VLM_PAPER_DATA``)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from bench.assets import AssetMissing
from bench.fl import split_clients
from bench.scenarios._vlm_api import caption_api, caption_utility, num_layers, recipe_config
from bench.scenarios._vlm_presets import PAPER_DATA_ENV, Spec
from bench.task import Task
from models import llm, vlm


class CocoItems(Dataset):
    """MSCOCO examples whose images are read (and resized to 224 px) on access; one training caption each."""

    def __init__(self, rows: Sequence[dict], root: Path, tokenizer, layout: vlm.PromptLayout, max_caption_tokens: int):
        self.rows, self.root, self.tok = list(rows), root, tokenizer
        self.layout, self.max_tokens = layout, max_caption_tokens

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def labels(self) -> list[int]:
        return [-1] * len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from PIL import Image

        r = self.rows[i]
        im = Image.open(self.root / r["filepath"] / r["filename"]).convert("RGB")
        im = im.resize((224, 224), Image.Resampling.BICUBIC)
        refs = [s["raw"].strip() for s in r["sentences"]]
        ids, cmask = self.layout.encode(vlm.caption_token_ids(self.tok, refs[0]), self.max_tokens)
        return {
            "image": torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0,
            "input_ids": ids,
            "caption_mask": cmask,
            "caption": refs[0],
            "refs": refs,
            "label": -1,
            "attrs": {},
        }


def paper_task(p: Spec) -> Task:
    """The paper preset's task: [FedRand]'s TinyLLaVA on MSCOCO's Karpathy split, members from train/restval,
    non-members and the test set from val/test (held-out MSCOCO, not [FedRand]'s NoCaps)."""
    tower, connector, lm_base, tok, cfg = vlm.tinyllava()  # AssetMissing at once when not cached
    folder = Path(os.environ.get(PAPER_DATA_ENV, ""))
    karpathy = folder / "dataset_coco.json"
    if not os.environ.get(PAPER_DATA_ENV) or not karpathy.is_file():
        raise AssetMissing(
            f"the vlm-caption paper preset needs MSCOCO 2014 (train2014/ and val2014/ images) with Karpathy's split "
            f"file dataset_coco.json in a folder named by ${PAPER_DATA_ENV}: download "
            f"http://images.cocodataset.org/zips/train2014.zip, val2014.zip and "
            f"https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip into it"
        )
    rows = json.loads(karpathy.read_text())["images"]
    rng = np.random.default_rng(p.data_seed)
    train = [rows[i] for i in rng.permutation(len(rows)) if rows[i]["split"] in ("train", "restval")]
    held = [rows[i] for i in rng.permutation(len(rows)) if rows[i]["split"] in ("val", "test")]
    if len(train) < p.n_members or len(held) < p.n_nonmembers + p.n_test:
        raise ValueError(
            f"{karpathy}: {len(train)} training / {len(held)} held-out images, the preset needs "
            f"{p.n_members} / {p.n_nonmembers + p.n_test}"
        )
    pid = llm.pad_id(tok)
    n_vis = (224 // 16) ** 2  # CLIP ViT-B/16 patch tokens
    layout = vlm.make_layout(tok, n_vis, pid)
    connector.requires_grad_(False)
    lora: dict[str, Any] = dict(r=p.lora_r, alpha=p.lora_alpha, dropout=p.lora_dropout, targets=p.lora_targets)

    def build_model() -> vlm.SmallVLM:
        lm = llm.add_lora(copy.deepcopy(lm_base), seed=p.model_seed, **lora)
        return vlm.SmallVLM(tower, copy.deepcopy(connector), lm, layout, features=vlm.clip_patch_features(cfg))

    def ds(rs):
        return CocoItems(rs, folder, tok, layout, p.max_caption_tokens)

    members = ds(train[: p.n_members])
    nonmembers = ds(held[: p.n_nonmembers])
    test = ds(held[p.n_nonmembers : p.n_nonmembers + p.n_test])
    parts = split_clients(members.labels, p.fl.num_clients, None, seed=p.data_seed)
    api = caption_api(
        p,
        tok,
        layout,
        build_model,
        arch="openelm",
        sizes=(num_layers(lm_base.config), int(lm_base.get_input_embeddings().weight.shape[0]), 224),
    )
    test_items = _LazyList(test)
    utility = caption_utility(p, api, test_items)
    config = {
        "model": vlm.TINYLLAVA_ID,
        "model_revision": vlm.TINYLLAVA_REVISION,
        "data": f"MSCOCO 2014, Karpathy split ({PAPER_DATA_ENV})",
        "n_members": len(members),
        "n_nonmembers": len(nonmembers),
        "n_test": len(test),
        "client_sizes": [len(c) for c in parts],
        **recipe_config(p),
    }
    return Task(
        scenario="vlm-caption",
        variant="",
        preset="paper",
        api=api,
        fl=p.fl,
        client_data=[Subset(members, idx) for idx in parts],
        test_data=test,
        utility=utility,
        nonmembers=nonmembers,
        central_data=members,
        central_epochs=p.fl.local_epochs,
        max_membership=p.max_membership,
        extras={"client_utility": True},
        config=config,
    )


class _LazyList(Sequence):
    """A read-only sequence view of a Dataset (items loaded on access)."""

    def __init__(self, ds: Dataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.ds[j] for j in range(*i.indices(len(self)))]
        return self.ds[i]
