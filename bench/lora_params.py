"""Helpers for federated LoRA defenses on peft models: find the LoRA A / B parameters, pair them per
adapted module, read the transformer layer index from a parameter name, and form B A products.

peft names look like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight``
(``lora_A`` has shape [r, in], ``lora_B`` [out, r]; the update is Delta W = scaling * B A, Hu et al. 2022).
Embedding LoRA (``lora_embedding_A`` / ``_B``, no ``.weight``) and conv LoRA (A [r, in, k, k],
B [out, r, 1, 1]) are paired the same way; :func:`as_matrix` flattens them to B [out, r] and A [r, *].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Literal, Sequence

import torch
from torch import Tensor

NEEDS_LORA = "needs LoRA adapters (a LoRA scenario)"

_LORA_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<emb>embedding_)?(?P<half>[AB])\.(?P<adapter>[^.]+)(?:\.weight)?$")
# container names whose numeric child is a transformer block (Llama/Mistral "layers", GPT-2 "h",
# ViT/timm "blocks", BERT "layer", T5 "block")
_LAYER_RE = re.compile(r"\.(?:layers|layer|h|blocks|block|decoder_layers|encoder_layers)\.(\d+)(?:\.|$)")
_ANY_INDEX_RE = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class LoraPair:
    """One adapted module: the names of its A and B parameters and the layer it sits in."""

    module: str  # the peft LoRA layer's module name (prefix of both parameter names)
    adapter: str  # peft adapter name ("default")
    a: str
    b: str
    layer: int | None


def requires_lora(api) -> str | None:
    """``Defense.applies`` for LoRA-only defenses: None when the task declares ``lora``, else the reason."""
    return None if api.lora is not None else NEEDS_LORA


def lora_half(name: str) -> Literal["A", "B"] | None:
    m = _LORA_RE.match(name)
    return m.group("half") if m else None  # type: ignore[return-value]


def is_lora(name: str) -> bool:
    return _LORA_RE.match(name) is not None


def layer_index(name: str) -> int | None:
    """Index of the transformer block a parameter belongs to (``...layers.3...`` -> 3), or None.

    Known block containers are preferred; otherwise the first ``.N.`` path component is used.
    """
    m = _LAYER_RE.search(name)
    if m:
        return int(m.group(1))
    m = _ANY_INDEX_RE.search(name)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=64)
def _pairs(names: tuple[str, ...]) -> tuple[LoraPair, ...]:
    halves: dict[tuple[str, str, bool], dict[str, str]] = {}
    for n in names:
        m = _LORA_RE.match(n)
        if m:
            key = (m.group("module"), m.group("adapter"), bool(m.group("emb")))
            halves.setdefault(key, {})[m.group("half")] = n
    out = []
    for (module, adapter, _), h in halves.items():
        if set(h) != {"A", "B"}:
            missing = "B" if "A" in h else "A"
            raise ValueError(
                f"LoRA module {module!r} (adapter {adapter!r}) has no lora_{missing} parameter "
                f"among the given names; found only {sorted(h.values())}"
            )
        out.append(LoraPair(module, adapter, h["A"], h["B"], layer_index(h["A"])))
    return tuple(out)


def lora_pairs(names: Iterable[str]) -> list[LoraPair]:
    """Pair every ``lora_A`` with its ``lora_B`` (same module and adapter), in name order of A.

    Raises ValueError when a half is missing: the defenses below need both halves.
    """
    return list(_pairs(tuple(names)))


def split_names(names: Iterable[str]) -> tuple[list[str], list[str], list[str]]:
    """(A names, B names, other names) of a parameter-name list, preserving order."""
    a: list[str] = []
    b: list[str] = []
    other: list[str] = []
    for n in names:
        h = lora_half(n)
        (a if h == "A" else b if h == "B" else other).append(n)
    return a, b, other


def num_layers(names: Iterable[str], depth: int | None = None) -> int:
    """Model depth: ``depth`` (the task's ``num_layers``) when the scenario gives it, else 1 + the largest
    LoRA layer index."""
    if depth:
        return int(depth)
    idx = [p.layer for p in lora_pairs(names) if p.layer is not None]
    if not idx:
        raise ValueError(
            "cannot infer the number of layers: no LoRA parameter name carries a layer index "
            "and the scenario declares no num_layers"
        )
    return max(idx) + 1


def as_matrix(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Flatten a LoRA pair to matrices B [out, r] and A [r, in*] so that Delta W = B @ A."""
    return b.reshape(b.shape[0], -1), a.reshape(a.shape[0], -1)


def lora_product(b: Tensor, a: Tensor) -> Tensor:
    """B A (without peft's alpha / r scaling, which is a constant of the layer), as a matrix [out, in*]."""
    bm, am = as_matrix(b, a)
    return bm @ am


def stack_pairs(
    bs: Sequence[Tensor], as_: Sequence[Tensor], weights: Sequence[float] | None = None
) -> tuple[Tensor, Tensor]:
    """Stacking of LoRA pairs ([DP-FedLoRA] Eq. 3, 12-13): B = [w_1 B_1, ..., w_K B_K] (side by side),
    A = [A_1; ...; A_K] (one below the other), so that B @ A = sum_k w_k B_k A_k exactly.
    """
    if len(bs) != len(as_) or not bs:
        raise ValueError("stack_pairs needs the same positive number of B and A matrices")
    weights = [1.0] * len(bs) if weights is None else list(weights)
    mats = [as_matrix(b, a) for b, a in zip(bs, as_)]
    b_stack = torch.cat([w * bm for w, (bm, _) in zip(weights, mats)], dim=1)
    a_stack = torch.cat([am for _, am in mats], dim=0)
    return b_stack, a_stack


def factor_rank_r(delta: Tensor, r: int, *, exact: bool | None = None) -> tuple[Tensor, Tensor, float]:
    """Best rank-r factorisation of a dense matrix (Eckart-Young, truncated SVD): B = U_r S_r, A = V_r^T.

    A gets orthonormal rows (the scale of a freshly initialised LoRA A); B carries the magnitudes.
    ``exact=None`` uses the full SVD up to min(shape) = 256 and above it the randomized SVD of Halko et
    al. 2011 (``torch.svd_lowrank``, r + 10 columns, 4 power iterations), which is near-optimal at a
    fraction of the cost. Returns (B [out, r], A [r, in], measured relative Frobenius error ||delta - BA|| / ||delta||).
    """
    d = delta.to(torch.float64)
    small = min(d.shape)
    if exact is None:
        exact = small <= 256
    if exact or r >= small:
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        v = vh.T
    else:
        u, s, v = torch.svd_lowrank(d, q=min(r + 10, small), niter=4)
    k = min(r, s.numel())
    b = torch.zeros(d.shape[0], r, dtype=torch.float64)
    a = torch.zeros(r, d.shape[1], dtype=torch.float64)
    b[:, :k] = u[:, :k] * s[:k]
    a[:k] = v[:, :k].T
    total = float(d.norm())
    err = float((d - b @ a).norm()) / total if total > 0 else 0.0
    return b.to(delta.dtype), a.to(delta.dtype), err


def factor_stacked_rank_r(b_stack: Tensor, a_stack: Tensor, r: int) -> tuple[Tensor, Tensor, float]:
    """:func:`factor_rank_r` of the product b_stack @ a_stack ([out, s] x [s, in]) without forming it:
    QR of both factors, SVD of the s x s core (exact, O((out + in) s^2)). Falls back to the dense SVD when
    s < r (A then still gets r orthonormal rows)."""
    s_dim = b_stack.shape[1]
    if s_dim < r:
        return factor_rank_r(b_stack @ a_stack, r, exact=True)
    qb, rb = torch.linalg.qr(b_stack.to(torch.float64))
    qa, ra = torch.linalg.qr(a_stack.T.to(torch.float64))
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    b = (qb @ u[:, :r]) * s[:r]
    a = vh[:r] @ qa.T
    total = float(s.norm())
    err = float(s[r:].norm()) / total if total > 0 else 0.0
    return b.to(b_stack.dtype), a.to(a_stack.dtype), err
