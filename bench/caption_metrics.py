"""Utility of a captioning model ([FedRand] s.4.1 "Evaluation metrics", Table 1): greedy captions of held-out
images scored against their references with BLEU-1..4 (Papineni et al. 2002), ROUGE-L (Lin 2004) and CIDEr-D
(Vedantam et al. 2015; the COCO evaluation server's variant) from ``pycocoevalcap``, plus grounding
accuracies parsed from the caption (the class noun of :data:`bench.captions.CLASS_NAMES` and the four
augmentation attributes) and the held-out caption loss.

Text is lower-cased and tokenised here (words, punctuation dropped, as the COCO PTBTokenizer does) instead of
by pycocoevalcap's PTBTokenizer, which needs Java. CIDEr's document frequencies come from the references of
the evaluated set itself (as in the COCO toolkit), so CIDEr values are comparable only across models scored
on the same held-out set. Scores are reported in percent, as [FedRand] Table 1 does.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import captions as cap
from .progress import progress
from .types import ScenarioModel

_WORD = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*")
# accepted spellings of each Fashion-MNIST class noun beside bench.captions' own (index -> phrases)
CLASS_ALIASES: dict[int, tuple[str, ...]] = {
    0: ("t-shirt", "t shirt", "tshirt", "tee"),
    1: ("pair of trousers", "trousers"),
    9: ("ankle boot", "boot"),
}


def tokenize(text: str) -> str:
    """Lower-case words joined by single spaces (punctuation removed; hyphenated words kept)."""
    return " ".join(_WORD.findall(text.lower()))


def _phrase_re(phrase: str) -> re.Pattern:
    words = tokenize(phrase).split()
    return re.compile(r"(?<![a-z0-9-])" + r"[\s-]+".join(map(re.escape, words)) + r"(?![a-z0-9-])")


_CLASS_PATTERNS: list[tuple[int, re.Pattern]] = []
for _i, _name in enumerate(cap.CLASS_NAMES):
    for _ph in dict.fromkeys((_name,) + CLASS_ALIASES.get(_i, ())):
        _CLASS_PATTERNS.append((_i, _phrase_re(_ph)))
_ATTR_PATTERNS: dict[str, list[tuple[str, re.Pattern]]] = {
    "size": [(k, _phrase_re(k)) for k in cap.SIZES],
    "tint": [(k, _phrase_re(k)) for k in cap.TINTS],
    "position": [(k, _phrase_re(k)) for k in cap.POSITIONS],
    "rotation": [(k, _phrase_re(k)) for k in cap.ROTATIONS],
}


def _first_match(text: str, patterns: Sequence[tuple[Any, re.Pattern]]) -> Any:
    """The value whose phrase occurs first in ``text`` (the longest phrase on a tie), else None."""
    best = None
    for value, pat in patterns:
        m = pat.search(text)
        if m and (best is None or (m.start(), -(m.end() - m.start())) < (best[0], -best[1])):
            best = (m.start(), m.end() - m.start(), value)
    return best[2] if best else None


def parse_class(text: str) -> int | None:
    """Index into CLASS_NAMES of the class noun a caption names first (whole words: "shirt" is not read inside
    "t-shirt"), or None when it names none."""
    return _first_match(tokenize(text), _CLASS_PATTERNS)


def parse_attributes(text: str) -> dict[str, str | None]:
    """The size / tint / position / rotation words a caption states (None where it states none)."""
    t = tokenize(text)
    return {k: _first_match(t, pats) for k, pats in _ATTR_PATTERNS.items()}


def caption_scores(references: Sequence[Sequence[str]], hypotheses: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU-1..4 (``bleu1``..``bleu4``), ROUGE-L (``rouge``) and CIDEr-D (``cider``), in percent, of
    ``hypotheses`` against their reference lists."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    if len(references) != len(hypotheses) or not hypotheses:
        raise ValueError(f"need one reference list per hypothesis, got {len(references)} and {len(hypotheses)}")
    gts = {i: [tokenize(r) for r in refs] for i, refs in enumerate(references)}
    # an empty hypothesis would divide by zero in ROUGE-L: score it as an out-of-vocabulary word
    res = {i: [tokenize(h) or "<empty>"] for i, h in enumerate(hypotheses)}
    if any(not refs for refs in gts.values()):
        raise ValueError("every hypothesis needs at least one reference")
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge, _ = Rouge().compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    out = {f"bleu{n + 1}": 100.0 * float(b) for n, b in enumerate(bleu)}
    out.update(rouge=100.0 * float(rouge), cider=100.0 * float(cider))  # "rouge" is ROUGE-L, as [FedRand] reports it
    return out


def grounding_scores(
    hypotheses: Sequence[str], labels: Sequence[int], attrs: Sequence[dict[str, Any]] | None = None
) -> dict[str, float]:
    """Exact class accuracy (the parsed class noun equals the image's class; a caption naming no class counts
    as wrong) and, when the true attributes are given, the accuracy of each stated attribute."""
    if len(hypotheses) != len(labels):
        raise ValueError("one label per hypothesis")
    out = {"class_acc": sum(parse_class(h) == int(y) for h, y in zip(hypotheses, labels)) / max(1, len(labels))}
    if attrs is not None:
        parsed = [parse_attributes(h) for h in hypotheses]
        for k in _ATTR_PATTERNS:
            out[f"{k}_acc"] = sum(p[k] == a.get(k) for p, a in zip(parsed, attrs)) / max(1, len(attrs))
    return out


def make_caption_utility(
    items: Sequence[dict[str, Any]],
    collate: Callable,
    *,
    generate: Callable[[ScenarioModel, Any], list[str]],
    loss_fn: Callable[[ScenarioModel, Any], tuple[torch.Tensor, torch.Tensor]],
    gen_items: int,
    batch_size: int = 16,
) -> Callable[[nn.Module], dict[str, float]]:
    """``utility(model)``: held-out caption loss / perplexity over ``items`` and caption metrics of greedy
    captions of the first ``gen_items`` of them. ``generate(model, batch) -> captions``; ``loss_fn(model,
    batch) -> (token nll, mask)``. Items carry "refs" (reference captions) and "label" ("attrs" optional);
    ``items`` may be a lazy sequence (sliced per batch, never materialised)."""
    n_gen = max(0, min(gen_items, len(items)))

    def utility(model: nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        total, count = 0.0, 0
        hyps: list[str] = []
        refs: list[list[str]] = []
        labels: list[int] = []
        attrs: list[dict] = []
        try:
            with torch.no_grad():
                for s in progress(range(0, len(items), batch_size), desc="utility caption loss", leave=False):
                    nll, mask = loss_fn(model, collate(items[s : s + batch_size]))
                    total += float(nll.sum())
                    count += int(mask.sum())
                for s in progress(range(0, n_gen, batch_size), desc="utility captions", leave=False):
                    chunk = items[s : min(s + batch_size, n_gen)]  # a lazy sequence loads only this chunk
                    hyps.extend(generate(model, collate(chunk)))
                    refs.extend(list(it["refs"]) for it in chunk)
                    labels.extend(int(it.get("label", -1)) for it in chunk)
                    attrs.extend(dict(it.get("attrs") or {}) for it in chunk)
        finally:
            model.train(was)
        loss = total / max(count, 1)
        out: dict[str, float] = {"test_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        if hyps:
            out.update(caption_scores(refs, hyps))
            if all(y >= 0 for y in labels):
                out.update(grounding_scores(hyps, labels, attrs if all(attrs) else None))
        return out

    return utility
