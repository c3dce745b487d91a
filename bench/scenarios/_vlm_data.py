"""The vlm-caption scenario's data: Fashion-MNIST items augmented on a canvas and captioned from what they show
(:mod:`bench.captions`), the private splits (members, non-members, test), the projector's public images and the
attacker's population, each item from its own seeded generator."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bench import captions as cap
from bench.data import fashion_mnist_for
from bench.scenarios._vlm_presets import Spec
from bench.text_data import stratified_split
from models import vlm


def fashion():
    return fashion_mnist_for("vlm-caption")


# Phrasings of one grounded caption (the first is bench.captions.caption). Each image is trained with one of
# them, drawn from its own seed; all are its references, as MSCOCO gives several captions per image. Natural
# captions are not a function of the image: a model that only generalises stays unsure of the phrasing of an
# unseen image, one that memorised a member is not - what MaxRényi-K% reads ([FedRand] Table 4).
TEMPLATES: tuple[str, ...] = (
    "a {size} {tint} {cls} {position}, {rotation}",
    "a photo of a {size} {tint} {cls} {position}, {rotation}",
    "there is a {size} {tint} {cls} {position}, {rotation}",
    "{position} there is a {size} {tint} {cls}, {rotation}",
    "a {tint} {cls} of {size} size {position}, {rotation}",
)


def phrasings(class_name: str, attrs: cap.Attributes) -> list[str]:
    return [
        t.format(size=attrs.size, tint=attrs.tint, cls=class_name, position=attrs.position, rotation=attrs.rotation)
        for t in TEMPLATES
    ]


def render_items(
    images: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int,
    split: int,
    canvas: int,
    tokenizer,
    layout: vlm.PromptLayout,
    max_caption_tokens: int,
    source_index: Sequence[int] | np.ndarray,
    detail: bool = False,
) -> list[dict]:
    """Augment and caption each 28x28 image with its own generator (seed, split, source index): the training
    caption is one of its :data:`TEMPLATES` phrasings, all of them are its references. ``detail``: the training
    caption ends with an annotator detail (drawn after the rest, so images and phrasings are unchanged); the
    references stay the grounded phrasings (the utility scores what the image shows)."""
    out = []
    for x28, y, src in zip(images, labels, source_index):
        rng = np.random.default_rng([seed, split, int(src)])
        x, a = cap.augment(x28, rng, canvas=canvas)
        refs = phrasings(cap.CLASS_NAMES[int(y)], a)
        text = refs[int(rng.integers(len(refs)))]
        if detail:
            text = f"{text}, {cap.detail(rng)}"
        ids, cmask = layout.encode(vlm.caption_token_ids(tokenizer, text), max_caption_tokens)
        out.append(
            {
                "image": x.half(),
                "input_ids": ids,
                "caption_mask": cmask,
                "caption": text,
                "refs": refs,
                "label": int(y),
                "attrs": {k: getattr(a, k) for k in ("size", "position", "rotation", "tint")},
                "source_index": int(src),
            }
        )
    return out


def _render(
    p: Spec, x: np.ndarray, y: np.ndarray, idx, *, split: int, tokenizer, layout: vlm.PromptLayout
) -> list[dict]:
    """``render_items`` of the source images at ``idx`` with the preset's seed, canvas and caption length (split 1,
    the private pool and the population, with the preset's annotator details; split 0, alignment, without)."""
    return render_items(
        x[idx],
        y[idx],
        seed=p.data_seed,
        split=split,
        canvas=p.canvas,
        tokenizer=tokenizer,
        layout=layout,
        max_caption_tokens=p.max_caption_tokens,
        source_index=idx,
        detail=p.caption_detail and split == 1,
    )


def caption_words(detail: bool = False) -> list[str]:
    """Every word the grounded captions use (the smoke tokenizer's vocabulary besides the prompt); ``detail``:
    with the annotator details' words."""
    phrases = (
        [w for t in TEMPLATES for w in t.replace(",", " , ").split() if not w.startswith("{")]
        + list(cap.CLASS_NAMES)
        + list(cap.SIZES)
        + list(cap.TINTS)
        + list(cap.POSITIONS)
        + list(cap.ROTATIONS)
    )
    if detail:
        phrases += [",", "a"]
        phrases += [*cap.DETAIL_PREPOSITIONS, *cap.DETAIL_ADJECTIVES, *cap.DETAIL_OBJECTS, *cap.DETAIL_PLACES]
    return [w for ph in phrases for w in ph.split()]


def private_splits(p: Spec, tokenizer, layout: vlm.PromptLayout) -> tuple[list[dict], list[dict], list[dict]]:
    """Members, non-members, test: disjoint class-stratified slices of the Fashion-MNIST test split."""
    src = fashion()
    n = len(src.test_y)
    sizes = (p.n_members, p.n_nonmembers, p.n_test)
    if sum(sizes) > n:
        raise ValueError(f"the private pool has {n} images, the preset needs {sum(sizes)}")
    splits = stratified_split(src.test_y, [s / n for s in sizes], seed=p.data_seed)
    members, nonmembers, test = (
        _render(p, src.test_x, src.test_y, sorted(s), split=1, tokenizer=tokenizer, layout=layout) for s in splits
    )
    return members, nonmembers, test


def public_items(p: Spec, tokenizer, layout: vlm.PromptLayout) -> list[dict]:
    """Projector-alignment images: ``n_public`` of the Fashion-MNIST *training* images (disjoint from the pool)."""
    src = fashion()
    idx = np.sort(np.random.default_rng(p.data_seed + 1).permutation(len(src.train_y))[: p.n_public])
    return _render(p, src.train_x, src.train_y, idx, split=0, tokenizer=tokenizer, layout=layout)


def population_items(p: Spec, tokenizer, layout: vlm.PromptLayout, used: Sequence[list[dict]], n: int) -> list[dict]:
    """Up to ``n`` Fashion-MNIST test images in none of the ``used`` splits (members, non-members, test), in a
    seeded order, augmented and captioned exactly as the private pool is (split 1, own source index)."""
    if n <= 0:
        return []
    src = fashion()
    taken = {int(it["source_index"]) for part in used for it in part}
    order = np.random.default_rng([p.data_seed, 0x504F50]).permutation(len(src.test_y)).tolist()
    idx = np.asarray([i for i in order if i not in taken][:n], dtype=np.int64)
    return _render(p, src.test_x, src.test_y, idx, split=1, tokenizer=tokenizer, layout=layout)
