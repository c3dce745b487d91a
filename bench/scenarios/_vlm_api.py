"""The vlm-caption task's model-facing functions: the collate, the sliced logits MaxRényi-K% reads, the caption
losses and greedy captioning (module level, so tasks pickle into worker processes). Used by every preset."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from models import vlm


def make_collate(pad_id: int) -> Callable[[Sequence[dict[str, Any]]], dict[str, Tensor]]:
    def collate(items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        """Right-pad the token sequences; images stacked as float [B, 3, H, W] in [0, 1]. Tensors only."""
        T = max(int(it["input_ids"].numel()) for it in items)
        ids = torch.full((len(items), T), int(pad_id), dtype=torch.long)
        am = torch.zeros((len(items), T), dtype=torch.long)
        cm = torch.zeros((len(items), T), dtype=torch.bool)
        for b, it in enumerate(items):
            n = int(it["input_ids"].numel())
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
