"""MaxRényi-K% membership inference ([FedRand] Eq. 11, from Li et al. 2024 "Membership Inference
Attacks against Large Vision-Language Models"), with its target-based relatives from one forward pass.

Per token position i of a slice, H_alpha(p(. | x_{1:i})) is the Rényi entropy of the next-token
distribution; MaxRényi-K% is the mean of the largest K% of them (K = 0: the maximum). Members are
predicted more confidently, so the score is the *negated* MaxRényi-K% (higher = member). Beside it:
Min-K% prob (Shi et al. 2024: mean of the lowest K% target log-probabilities), the loss (mean target
NLL; perplexity is its monotone transform, same AUROC) and ModRényi (Li et al. 2024, target-aware).
All are reductions of the per-token signals of ``bench.signals.token_signals``.

Primary score: ``maxrenyi_K10_a0.5_<part>``. [FedRand] reports MaxRényi-0% and -10% (Table 4) and uses
MaxRényi-10% alone as its headline in the ablation (Table 3); it does not state the order, and Li et al.
use alpha = 0.5 as their main setting, so K = 10, alpha = 0.5. The part is the caption/text slice
("caption", then "text", then the first slice with targets), where [FedRand] Table 4 finds the signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from bench.params import param
from bench.registry import register_attack
from bench.signals import PartSignals, alpha_name, masked_topk_means, token_signals
from bench.types import Attack, Observation, Scores, TaskSpec

DEFAULT_KS = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)


def part_scores(
    part: str, sig: PartSignals, *, alphas: Sequence[float], ks: Sequence[int], mod_alphas: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Every score of one slice from its per-token signals (higher = member): one sort per signal
    serves every K (``masked_topk_means``)."""
    out: dict[str, torch.Tensor] = {}
    for a in alphas:
        for k, v in masked_topk_means(sig.entropy[a], sig.mask, ks, largest=True).items():
            out[f"maxrenyi_K{k}_a{alpha_name(a)}_{part}"] = -v
    if sig.target_logprob is not None:
        low = masked_topk_means(sig.target_logprob, sig.mask, sorted({*ks, 100}), largest=False)
        for k in ks:
            if k < 100:  # Min-100% prob is the negated loss below
                out[f"mink_K{k}_{part}"] = low[k]
        out[f"loss_{part}"] = low[100]
        n = sig.mask.sum(1).double()
        for a in mod_alphas:
            out[f"modrenyi_a{alpha_name(a)}_{part}"] = -(sig.mod_entropy[a].double() * sig.mask).sum(1) / n
    return out


def slice_tokens(signals: dict[str, PartSignals]) -> dict[str, dict[str, float | int]]:
    """Each slice's scored token positions per candidate (mean / min / max / candidates): MaxRenyi-K% averages
    the top ``max(1, floor(K% x n))`` of them, so K = 0 and K = 10 coincide on slices under 20 tokens."""
    out = {}
    for part, sig in signals.items():
        n = sig.mask.sum(1).double()
        out[part] = {
            "mean": float(n.mean()),
            "min": float(n.min()),
            "max": float(n.max()),
            "candidates": int(n.numel()),
        }
    return out


@register_attack
@dataclass
class MaxRenyi(Attack):
    alphas: tuple[float, ...] = param((0.5, 1.0, 2.0, math.inf), ge=0.0, allow_inf=True)  # Rényi orders
    ks: tuple[int, ...] = param(DEFAULT_KS, ge=0, le=100)  # K in percent
    mod_alphas: tuple[float, ...] = param((0.5, 1.0, 2.0), ge=0.0, le=1e3)
    primary_k: int = param(10, ge=0, le=100)
    primary_alpha: float = param(0.5, ge=0.0, allow_inf=True)
    primary_part: str = ""  # "" = caption, else text, else the first slice with targets
    batch_size: int = param(8, ge=1, le=4096)
    chunk_rows: int = param(8, ge=1, le=1 << 20)  # token positions per chunk: a few [chunk_rows, vocab] buffers

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    paper = "[FedRand] Eq. 11 (MaxRényi-K%, Li et al. 2024); Min-K% prob (Shi et al. 2024)"
    requires = ("logits", "parts")  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def __post_init__(self) -> None:
        if not self.alphas:
            raise ValueError("alphas must not be empty")
        if any(a < 0 for a in self.alphas):
            raise ValueError(f"Rényi orders must be >= 0, got {self.alphas}")
        if any(not 0 <= k <= 100 for k in self.ks):
            raise ValueError(f"K values must be in [0, 100], got {self.ks}")
        for name in ("alphas", "ks", "mod_alphas"):  # a repeat would name two score variants alike
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} must not repeat a value, got {values}")
        if self.primary_k not in self.ks or self.primary_alpha not in self.alphas:
            raise ValueError(
                f"primary K={self.primary_k}, alpha={self.primary_alpha} must be among "
                f"ks={self.ks} and alphas={self.alphas}"
            )

    def applies(self, task: TaskSpec) -> str | None:
        if not task.parts:  # the LM logits' slices: declared iff api.logits
            return "needs a language-model head (api.logits)"
        return None

    def choose_part(self, parts: Sequence[str], signals: dict[str, PartSignals]) -> str:
        if self.primary_part:
            if self.primary_part not in parts:
                raise ValueError(f"primary_part {self.primary_part!r} is not one of the task's parts {list(parts)}")
            return self.primary_part
        for p in ("caption", "text"):
            if p in parts:
                return p
        with_targets = [p for p in parts if signals[p].target_logprob is not None]
        return (with_targets or list(parts))[0]

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        reason = self.applies(obs.api)
        if reason:
            raise ValueError(reason)
        if obs.model is None:
            raise ValueError(f"max_renyi needs a model in the observation (view {obs.view!r})")
        items = list(candidates or [])
        if not items:
            raise ValueError("max_renyi needs candidates to score")
        parts = list(obs.api.parts or ("text",))
        signals = token_signals(
            obs.api,
            obs.model,
            items,
            alphas=self.alphas,
            mod_alphas=self.mod_alphas,
            batch_size=self.batch_size,
            chunk_rows=self.chunk_rows,
            parts=parts,
            desc=f"max_renyi {obs.view}",
            cache=obs.signals,
        )
        scores: dict[str, torch.Tensor] = {}
        for part in parts:
            scores.update(part_scores(part, signals[part], alphas=self.alphas, ks=self.ks, mod_alphas=self.mod_alphas))
        part = self.choose_part(parts, signals)
        primary = f"maxrenyi_K{self.primary_k}_a{alpha_name(self.primary_alpha)}_{part}"
        tokens = slice_tokens({p: signals[p] for p in parts})  # what K% of each slice means, for the record
        return Scores(scores, primary=primary, details={"slice_tokens": tokens})
