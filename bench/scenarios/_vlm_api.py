"""The vlm-caption task's model-facing functions: the collate, the sliced logits MaxRényi-K% reads, the caption
losses and greedy captioning (module level, so tasks pickle into worker processes). Used by every preset."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from bench.caption_metrics import make_caption_utility
from bench.scenarios._vlm_presets import Spec
from bench.text_data import token_length
from bench.types import CaptionSpec, LoraSpec, TaskAPI, TokenSpec
from models import vlm


def make_collate(pad_id: int) -> Callable[[Sequence[dict[str, Any]]], dict[str, Tensor]]:
    def collate(items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        """Right-pad the token sequences; images stacked as float [B, 3, H, W] in [0, 1]. Tensors only."""
        T = max(token_length(it) for it in items)
        ids = torch.full((len(items), T), int(pad_id), dtype=torch.long)
        am = torch.zeros((len(items), T), dtype=torch.long)
        cm = torch.zeros((len(items), T), dtype=torch.bool)
        for b, it in enumerate(items):
            n = token_length(it)
            ids[b, :n] = it["input_ids"]
            am[b, :n] = 1
            cm[b, :n] = it["caption_mask"]
        images = torch.stack([torch.as_tensor(it["image"]).float() for it in items])
        labels = torch.tensor([int(it.get("label", -1)) for it in items], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": am, "caption_mask": cm, "images": images, "labels": labels}

    return collate


# ----------------------------------------------------------------------------------------------
# task API: losses, sliced logits, captions


def vlm_logits(model: vlm.SmallVLM, batch: dict[str, Tensor], part: str) -> tuple[Tensor, Tensor | None, Tensor]:
    """The slices of [FedRand] Table 4 (Li et al. 2024's image / description slices), shifted:

    - ``"caption"``: logits [B, T', V] at the positions predicting each caption token (and eos), its
      targets [B, T'] and mask [B, T'] (padding off);
    - ``"image"``: the next-token distributions at the visual-token positions [B, N, V], targets None (only
      entropies). The LM is causal, so these are computed from the prefix up to the last visual token."""
    lay = model.layout
    dev = model.lm.get_input_embeddings().weight.device
    ids, images = batch["input_ids"].to(dev), batch["images"].to(dev)
    if part == "image":  # the prompt has no padding
        e = lay.image_end
        logits = model(ids[:, :e], None, images, keep=lay.num_image_tokens).float()
        return logits, None, torch.ones(logits.shape[:2], dtype=torch.bool, device=dev)
    if part == "caption":  # right padding under causal attention: no mask needed (models.vlm.caption_nll)
        s = lay.prompt_len - 1  # the logit at position t predicts token t + 1
        logits = model(ids, None, images, keep=ids.shape[1] - s)[:, :-1].float()
        return logits, ids[:, s + 1 :], batch["caption_mask"].to(dev)[:, s + 1 :].bool()
    raise ValueError(f"vlm-caption has the parts 'image' and 'caption', got {part!r}")


def vlm_loss(model: vlm.SmallVLM, batch: dict[str, Tensor]) -> Tensor:
    """Mean caption-token NLL over the batch ([FedRand] Eq. 1)."""
    return vlm.caption_loss(model, batch)


def vlm_per_sample_loss(model: vlm.SmallVLM, batch: dict[str, Tensor]) -> Tensor:
    """[B]: each example's mean caption-token NLL."""
    nll, mask = vlm.caption_nll(model, batch)
    return nll.sum(1) / mask.sum(1).clamp(min=1)


def make_generate(tokenizer, max_new_tokens: int) -> Callable[[vlm.SmallVLM, dict[str, Tensor]], list[str]]:
    def generate(model: vlm.SmallVLM, batch: dict[str, Tensor]) -> list[str]:
        """Greedy captions of the batch's images, decoded without special tokens."""
        ids = model.generate(batch["images"], max_new_tokens=max_new_tokens)
        return [tokenizer.decode(x, skip_special_tokens=True).strip() for x in ids]

    return generate


def caption_api(
    p: Spec,
    tokenizer,
    layout: vlm.PromptLayout,
    build_model: Callable[[], vlm.SmallVLM],
    *,
    arch: str,
    sizes: tuple[int, int, int],
    **extra: Any,
) -> TaskAPI:
    """The vlm-caption TaskAPI of every preset: LoRA on the language model, the image / caption slices of the
    logits, the caption losses, greedy captioning. ``sizes``: (transformer blocks, vocabulary, image side in px);
    ``extra``: ``num_classes`` (grounded captions) and ``population_size``."""
    num_layers, vocab, image_size = sizes
    return TaskAPI(
        name="vlm-caption",
        family="vlm-caption",
        arch=arch,
        num_layers=num_layers,
        lora=LoraSpec(r=p.lora_r, alpha=p.lora_alpha, targets=tuple(p.lora_targets)),
        parts=("image", "caption"),
        tokens=TokenSpec(vocab_size=vocab, max_len=layout.prompt_len + p.max_caption_tokens + 1, pad_id=layout.pad_id),
        caption=CaptionSpec(
            num_image_tokens=layout.num_image_tokens,
            image_start=layout.image_start,
            prompt_len=layout.prompt_len,
            image_size=image_size,
            num_classes=extra.get("num_classes"),
            generate=make_generate(tokenizer, p.gen_tokens),
        ),
        loss=vlm_loss,
        per_sample_loss=vlm_per_sample_loss,
        collate=make_collate(layout.pad_id),
        build_model=build_model,
        logits=vlm_logits,
        length=token_length,
        population_size=int(extra.get("population_size", 0)),
    )


def recipe_config(p: Spec) -> dict[str, Any]:
    """What every preset's ``Task.config`` records of the recipe: LoRA, the prompt, the seeds, the preset's notes."""
    return {
        "lora": {"r": p.lora_r, "alpha": p.lora_alpha, "dropout": p.lora_dropout, "targets": list(p.lora_targets)},
        "prompt": vlm.PROMPT_PRE + "{image}" + vlm.PROMPT_POST,
        "data_seed": p.data_seed,
        "model_seed": p.model_seed,
        **p.notes,
    }


def caption_utility(p: Spec, api: TaskAPI, items: Sequence[dict[str, Any]]) -> Callable:
    """Every preset's utility (:func:`bench.caption_metrics.make_caption_utility`): the held-out caption NLL and the
    captions of ``p.gen_items`` held-out images, scored against their references."""
    if api.caption is None or api.caption.generate is None:
        raise ValueError("a vlm-caption TaskAPI captions (caption_api)")
    return make_caption_utility(
        items, api.collate, generate=api.caption.generate, loss_fn=vlm.caption_nll, gen_items=p.gen_items, batch_size=16
    )


def num_layers(config) -> int:
    """Transformer blocks of the LM: OpenELM names them ``num_transformer_layers``, Llama-like configs
    ``num_hidden_layers``."""
    n = getattr(config, "num_transformer_layers", None) or getattr(config, "num_hidden_layers", None)
    if not n:
        raise ValueError(f"{type(config).__name__} names no layer count (num_transformer_layers / num_hidden_layers)")
    return int(n)
