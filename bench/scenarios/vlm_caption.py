"""Scenario ``vlm-caption``: a vision-language model fine-tuned with LoRA on private captioned images split
over clients - the setting of [FedRand] (FedRand, s.4.1: TinyLLaVA, LoRA on the language model only,
MSCOCO captioning, Dirichlet(0.5) non-IID split, MaxRényi-K% membership inference on the image and caption
slices, Table 4).

No real image-caption set installs offline (docs/design.md s.3): images are Fashion-MNIST items on a colour
canvas with a procedural augmentation and the caption states the class and the augmentation
(:mod:`bench.captions`), so captions are grounded in and differ per image. Members, non-members and the
held-out test set are disjoint class-stratified slices of one pool (the Fashion-MNIST test split: an attack
on the un-fine-tuned model sits at AUROC 0.5 - unlike [FedRand]'s MSCOCO-vs-NoCaps pairing, which is a
distribution shift). The projector is aligned once on public images (the Fashion-MNIST *training* split,
disjoint from the pool) and then frozen (:mod:`models.vlm`). Presets:

- ``smoke``: tiny random CNN + tiny random Llama, a few hundred images, over-fits in seconds on purpose.
- ``default``: EfficientNet-Lite0 (ImageNet, its 7x7 map as 49 visual tokens) + SmolLM2-135M-Instruct, LoRA
  r=16 on every linear layer, AdamW 5e-3 (wd 1e-6, batch 8 as [FedRand] s.4.1), 312 members over 4 clients,
  6 rounds of 3 local epochs.
- ``paper``: TinyLLaVA-OpenELM-450M-CLIP-0.55B and MSCOCO (Karpathy split) with [FedRand]'s settings
  (12 clients, 4 per round, 30 rounds, rank 8); local files only.

The presets' pinned values and their measurements are in :mod:`bench.scenarios._vlm_presets`, the data in
:mod:`bench.scenarios._vlm_data`, the model-facing functions (collate, losses, sliced logits) in
:mod:`bench.scenarios._vlm_api`, the ``paper`` preset's loaders in :mod:`bench.scenarios._vlm_paper`; this module
builds the task from them (the registry key is this file's name).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

from torch import nn
from torch.utils.data import Subset

from bench import captions as cap
from bench.data import Items
from bench.fl import split_clients
from bench.registry import register_scenario
from bench.scenarios._vlm_api import (
    caption_api,
    caption_utility,
    make_collate,
    make_generate,
    num_layers,
    recipe_config,
    vlm_logits,
    vlm_loss,
    vlm_per_sample_loss,
)
from bench.scenarios._vlm_data import (
    caption_words,
    fashion,
    population_items,
    private_splits,
    public_items,
    render_items,
)
from bench.scenarios._vlm_paper import paper_task
from bench.scenarios._vlm_presets import N_POPULATION, PAPER_DATA_ENV, SPECS, Spec
from bench.task import Task, preset_entry
from bench.text_data import stratified_split
from bench.types import LoraSpec
from models import llm, vlm, vlm_align

__all__ = [  # the scenario's names, wherever they live (tests and users import them from here)
    "N_POPULATION",
    "PAPER_DATA_ENV",
    "SPECS",
    "Spec",
    "build",
    "build_task",
    "caption_words",
    "effnet_smollm2_name",
    "make_collate",
    "make_generate",
    "preparations",
    "projector_spec",
    "render_items",
    "specs",
    "vlm_logits",
    "vlm_loss",
    "vlm_per_sample_loss",
]


# ----------------------------------------------------------------------------------------------
# models per preset


def effnet_smollm2_name(p: Spec) -> str:
    """The default model as recorded (and in the projector's cache key): the encoder's input size included."""
    return (
        f"EfficientNet-Lite0 (ImageNet, {p.encoder_size} px) + {llm.SMOLLM2_NAME} "
        f"({llm.SMOLLM2_PACKAGE} {llm.md.version(llm.SMOLLM2_PACKAGE)} GGUF)"
    )


def _encoder_and_lm(p: Spec) -> tuple[vlm.FrozenEncoder, Callable[[], nn.Module], Any, dict[str, Any]]:
    """(frozen encoder, factory of fresh base LMs, tokenizer, what to record in the task config)."""
    if p.model == "tiny":
        tok = vlm.word_tokenizer(vlm.prompt_words() + caption_words(p.caption_detail))
        make = lambda: llm.tiny_llama(tok, p.model_seed, **p.tiny)  # noqa: E731
        return vlm.TinyCNN(p.model_seed), make, tok, _model_record(p, len(tok))
    if p.model == "effnet-smollm2":
        base, tok = llm.smollm2_base()
        encoder = vlm.EfficientNetLite0Map(p.encoder_size)
        return encoder, (lambda: copy.deepcopy(base)), tok, _model_record(p, None)
    raise ValueError(f"unknown VLM {p.model!r}")


def _model_record(p: Spec, vocab: int | None) -> dict[str, Any]:
    """The model as ``Task.config`` records it (``vocab``: the smoke word tokenizer's size)."""
    if p.model == "tiny":
        return {
            "model": f"tiny VLM: random CNN (seed {p.model_seed}) + tiny-llama(random, seed {p.model_seed}, {p.tiny})",
            "tokenizer": f"word-level, {vocab} tokens (prompt + caption vocabulary)",
        }
    if p.model == "effnet-smollm2":
        return {"model": effnet_smollm2_name(p)}
    raise ValueError(f"unknown VLM {p.model!r}")


def _task_record(p: Spec, model_cfg: dict[str, Any]) -> dict[str, Any]:
    """What build_task adds to the model record (the projector's recipe, the data, the canvas)."""
    return {
        **model_cfg,
        "projector": {
            "stage1_steps": p.projector_steps,
            "n_public": p.n_public,
            "batch": p.projector_batch,
            "lr": p.projector_lr,
            "trained_in_fl": p.train_projector,
            "spec": projector_spec(p, model_cfg["model"]),
        },
        "data": "fashion-mnist test split (Debian dataset-fashion-mnist), grounded captions"
        + (" + annotator details (bench.captions.detail)" if p.caption_detail else ""),
        "canvas": p.canvas,
    }


def projector_spec(p: Spec, model: str) -> dict[str, Any]:
    """What the aligned projector depends on (its cache key, ``models.vlm_align.projector_key``): the model (encoder
    size included), the visual-token grid, the canvas, the prompt and the public data."""
    return {
        "model": model,
        "side": p.side,
        "canvas": p.canvas,
        "prompt": vlm.PROMPT_PRE + vlm.PROMPT_POST,
        "data": {
            "source": "fashion-mnist train",
            "n": p.n_public,
            "seed": p.data_seed,
            "captions": "bench.captions v1",
        },
        "model_seed": p.model_seed,
    }


def build_task(preset: str) -> Task:
    p = preset_entry(SPECS, preset)
    if p.model == "tinyllava":
        return paper_task(p)
    encoder, make_lm, tok, model_cfg = _encoder_and_lm(p)
    pid = llm.pad_id(tok)
    layout = vlm.make_layout(tok, p.side * p.side, pid)
    members, nonmembers, test = private_splits(p, tok, layout)
    population = population_items(p, tok, layout, (members, nonmembers, test), N_POPULATION[preset])
    collate = make_collate(pid)
    lora: dict[str, Any] = dict(r=p.lora_r, alpha=p.lora_alpha, dropout=p.lora_dropout, targets=p.lora_targets)

    def assemble(projector_state: dict | None) -> vlm.SmallVLM:
        return vlm.build_vlm(
            copy.deepcopy(encoder),
            make_lm(),
            layout,
            side=p.side,
            projector_state=projector_state,
            lora=lora,
            seed=p.model_seed,
            train_projector=p.train_projector,
        )

    spec = projector_spec(p, model_cfg["model"])
    holder: dict[str, Any] = {}

    def aligned() -> vlm.SmallVLM:
        """The VLM with the stage-1 aligned projector, pre-trained (or loaded from its cache) on first use, so
        building the task (``bench list``, planning) stays cheap."""
        if p.projector_steps and "state" not in holder:
            holder["state"], holder["log"], _ = vlm_align.load_or_pretrain_projector(
                spec,
                lambda: assemble(None),
                lambda: public_items(p, tok, layout),
                collate,
                steps=p.projector_steps,
                batch_size=p.projector_batch,
                lr=p.projector_lr,
                seed=p.data_seed,
            )
        return assemble(holder.get("state"))

    aligned.holder = holder  # type: ignore[attr-defined]
    return _assemble(
        preset,
        p,
        aligned,
        tok,
        layout,
        members,
        nonmembers,
        test,
        _task_record(p, model_cfg),
        probe=lambda: assemble(None),
        population=population,
    )


def _assemble(
    preset: str,
    p: Spec,
    build_model: Callable[[], vlm.SmallVLM],
    tok,
    layout: vlm.PromptLayout,
    members: list[dict],
    nonmembers: list[dict],
    test: list[dict],
    model_cfg: dict[str, Any],
    *,
    probe: Callable[[], vlm.SmallVLM] | None = None,
    population: list[dict] | None = None,
) -> Task:
    member_ds, nonmember_ds, test_ds = Items(members), Items(nonmembers), Items(test)
    parts = split_clients(member_ds.labels, p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed)
    client_data = [Subset(member_ds, idx) for idx in parts]
    probe = (probe or build_model)()  # the architecture only (no projector pre-training)
    sizes = (
        num_layers(probe.lm.get_base_model().config),
        int(probe.lm.get_input_embeddings().weight.shape[0]),
        p.canvas,
    )
    del probe
    api = caption_api(
        p,
        tok,
        layout,
        build_model,
        arch="llama",
        sizes=sizes,
        num_classes=len(cap.CLASS_NAMES),
        population_size=len(population or ()),
    )
    utility = caption_utility(p, api, test_ds.items)
    config = _assemble_config(p, model_cfg, (len(member_ds), len(nonmember_ds), len(test_ds)), [len(c) for c in parts])
    return Task(
        scenario="vlm-caption",
        variant="",
        preset=preset,
        api=api,
        fl=p.fl,
        client_data=client_data,
        test_data=test_ds,
        utility=utility,
        nonmembers=nonmember_ds,
        central_data=member_ds,
        central_epochs=p.central_epochs or p.fl.local_epochs,
        max_membership=p.max_membership,
        extras={"client_utility": True},
        config=config,
        population=Items(population) if population else None,
    )


def _assemble_config(
    p: Spec, model_cfg: dict[str, Any], sizes: tuple[int, int, int], client_sizes: list[int]
) -> dict[str, Any]:
    """``Task.config`` (smoke / default): the model record, the prompt, the split sizes (members, non-members,
    test) and the clients' sizes."""
    return {
        **model_cfg,
        **recipe_config(p),
        "side": p.side,
        "n_members": sizes[0],
        "n_nonmembers": sizes[1],
        "n_test": sizes[2],
        "client_sizes": client_sizes,
        "gen_items": p.gen_items,
        "gen_tokens": p.gen_tokens,
    }


def _declared_config(preset: str) -> dict[str, Any]:
    """``Task.config`` from the labels and the split alone (nothing rendered, no tokenizer or model built): what
    :func:`build_task` records on smoke / default, for planning a cached run (bench.specs)."""
    p = preset_entry(SPECS, preset)
    src = fashion()
    n = len(src.test_y)
    sizes = (p.n_members, p.n_nonmembers, p.n_test)
    splits = stratified_split(src.test_y, [s / n for s in sizes], seed=p.data_seed)
    labels = [int(y) for y in src.test_y[sorted(splits[0])]]
    parts = split_clients(labels, p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed)
    vocab = len(vlm.word_vocab(vlm.prompt_words() + caption_words(p.caption_detail))) if p.model == "tiny" else None
    model_cfg = _task_record(p, _model_record(p, vocab))
    return _assemble_config(p, model_cfg, (len(splits[0]), len(splits[1]), len(splits[2])), [len(c) for c in parts])


# One-off preparation (bench.preparations): the stage-1 projector alignment, 8.1-8.4 s per step at 1 thread here
# (sessions 2026-11-27 and 2026-12-01: ~27-28 min for 200 steps); smoke's takes seconds and is not declared.
ALIGN_SECONDS_PER_STEP = {"default": 8.3}


def preparations(preset: str) -> list:
    """The aligned projector when the preset aligns one and it takes long (bench.preparations)."""
    from bench.preparations import Preparation

    p = preset_entry(SPECS, preset)
    per_step = ALIGN_SECONDS_PER_STEP.get(preset)
    if p.model != "effnet-smollm2" or not p.projector_steps or per_step is None:
        return []
    stem = vlm_align.projector_stem(
        projector_spec(p, effnet_smollm2_name(p)),
        steps=p.projector_steps,
        batch_size=p.projector_batch,
        lr=p.projector_lr,
        seed=p.data_seed,
        create=False,
    )
    return [Preparation("vlm-caption projector alignment", ("vlm-caption",), stem, per_step * p.projector_steps)]


# Transformer blocks of the default preset's LM (SmolLM2-135M's num_hidden_layers), so planning loads no model.
NUM_LAYERS = {"effnet-smollm2": 30}


def specs(preset: str):
    """The task as ``bench list`` plans it, without rendering data or loading a model (bench.specs); None on
    ``paper`` (building checks its model and data) and when Fashion-MNIST is not installed (building says so)."""
    from bench.specs import DeclaredTask, LazyConfig, fashion_mnist_installed
    from bench.types import TaskSpec

    p = preset_entry(SPECS, preset)
    if p.model == "tinyllava" or not fashion_mnist_installed():
        return None
    layers = p.tiny["layers"] if p.model == "tiny" else NUM_LAYERS[p.model]
    return [
        DeclaredTask(
            "vlm-caption",
            TaskSpec(
                name="vlm-caption",
                family="vlm-caption",
                arch="llama",
                num_layers=layers,
                lora=LoraSpec(r=p.lora_r, alpha=p.lora_alpha, targets=tuple(p.lora_targets)),
                parts=("image", "caption"),
                population_size=N_POPULATION[preset],
            ),
            p.fl,
            config=LazyConfig(functools.partial(_declared_config, preset)),
        )
    ]


@register_scenario(name="vlm-caption")
def build(preset: str) -> list[Task]:
    return [build_task(preset)]
