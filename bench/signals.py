"""Per-sample model signals for membership inference, computed once and shared by every score (docs/design.md s.7).

One forward pass per batch of candidates gives, per token position of each ``api.parts`` slice,
the Rényi entropies of the next-token distribution, the target token's log-probability and the modified
Rényi entropies; every MaxRényi-K% / Min-K% / loss / ModRényi score is then a cheap reduction of these
(``masked_topk_mean``). The per-sample losses and gradient norms of the loss- and gradient-based attacks are in
:mod:`bench.loss_signals`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from .progress import progress
from .signal_cache import Codec, SignalCache, cached
from .types import TaskAPI

INF = math.inf

# ----------------------------------------------------------------------------------------------
# entropies of next-token distributions (pure functions on log-probabilities)


def renyi_entropy(logp: Tensor, alpha: float) -> Tensor:
    """Rényi entropy H_alpha = log(sum_i p_i^alpha) / (1 - alpha) of each distribution in ``logp`` [..., V].

    alpha = 1 is the Shannon limit -sum p log p, alpha = inf the min-entropy -log max p (Rényi 1961;
    the per-token quantity of MaxRényi-K%, [FedRand] Eq. 11 / Li et al. 2024). Natural log.
    """
    return _renyi(logp, logp.exp(), alpha)


def _renyi(logp: Tensor, p: Tensor, alpha: float) -> Tensor:
    if alpha < 0:
        raise ValueError(f"Rényi order must be >= 0, got {alpha}")
    if alpha == 1:
        return -torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype)).sum(-1)
    if math.isinf(alpha):
        return -logp.max(-1).values
    if alpha == 2:  # sum p^2 >= 1/V: no underflow, one pass cheaper than logsumexp
        return -(p * p).sum(-1).log()
    if alpha == 0.5:  # sum sqrt(p) >= 1
        return 2.0 * p.sqrt().sum(-1).log()
    return torch.logsumexp(alpha * logp, dim=-1) / (1.0 - alpha)


def modified_renyi_entropy(logp: Tensor, target: Tensor, alpha: float) -> Tensor:
    """Target-aware modified Rényi entropy (ModRényi, Li et al. 2024 s.4; alpha = 1 is the modified
    entropy of Song & Mittal 2021): low when the target token is confidently predicted.

    MH_a = -1/|1-a| [ (1-p_y) p_y^|1-a| - (1-p_y) + sum_{j!=y} p_j ((1-p_j)^|1-a| - 1) ],
    MH_1 = -(1-p_y) log p_y - sum_{j!=y} p_j log(1-p_j).    ``logp`` [..., V], ``target`` [...].
    """
    return _mod_renyi(_mod_terms(logp, target), alpha)


def _mod_terms(logp: Tensor, target: Tensor, p: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Shared pieces of ModRényi for every order: p_y, log p_y, and p_j off the target (0 at j = y)."""
    p = logp.exp() if p is None else p
    idx = target.unsqueeze(-1)
    py, logpy = p.gather(-1, idx).squeeze(-1), logp.gather(-1, idx).squeeze(-1)
    return py, logpy, p.scatter(-1, idx, 0.0)


def _mod_renyi(terms: tuple[Tensor, Tensor, Tensor], alpha: float) -> Tensor:
    py, logpy, p_off = terms
    if alpha == 1:
        return -(1 - py) * logpy - (p_off * torch.log1p(-p_off.clamp(max=1 - 1e-12))).sum(-1)
    a = abs(1.0 - alpha)
    head = (1 - py) * torch.expm1(a * logpy)  # (1-p_y)(p_y^a - 1)
    if a == 1:  # alpha = 2 (or 0): (1-p_j) - 1 = -p_j
        tail = -(p_off * p_off).sum(-1)
    elif a == 0.5:  # alpha = 0.5 or 1.5
        tail = (p_off * ((1 - p_off).clamp(min=0).sqrt() - 1)).sum(-1)
    else:
        tail = (p_off * torch.expm1(a * torch.log1p(-p_off.clamp(max=1 - 1e-12)))).sum(-1)
    return -(head + tail) / a  # tail = sum_{j!=y} p_j ((1-p_j)^a - 1)


def masked_topk_mean(values: Tensor, mask: Tensor, k_percent: float, *, largest: bool) -> Tensor:
    """Mean of the largest (or smallest) K% of each row's masked values: [N, T] -> [N].

    K% of n positions is floor(n K / 100), at least one, so K = 0 is the max (min) and K = 100 the mean
    ([FedRand] Eq. 11: MaxRényi-0% is the maximum; Min-K% prob of Shi et al. 2024 likewise).
    """
    if not 0 <= k_percent <= 100:
        raise ValueError(f"K must be in [0, 100], got {k_percent}")
    n = mask.sum(1)
    if (n == 0).any():
        bad = torch.nonzero(n == 0).flatten()[:5].tolist()
        raise ValueError(f"candidates {bad} have no token positions in this part; cannot score them")
    k = torch.clamp((n.double() * k_percent / 100.0 + 1e-9).floor().long(), min=1)
    fill = -INF if largest else INF
    v = values.double().masked_fill(~mask, fill).sort(dim=1, descending=largest).values
    # only the first k (finite) entries of each row are summed
    first = torch.arange(v.shape[1]).unsqueeze(0) < k.unsqueeze(1)
    return torch.where(first, v, torch.zeros_like(v)).sum(1) / k


def masked_topk_means(values: Tensor, mask: Tensor, ks: Sequence[float], *, largest: bool) -> dict[float, Tensor]:
    """:func:`masked_topk_mean` for several K at once: one sort and one cumulative sum per row serve
    every K (the MaxRényi-K% / Min-K% grids)."""
    if any(not 0 <= k <= 100 for k in ks):
        raise ValueError(f"K must be in [0, 100], got {list(ks)}")
    n = mask.sum(1)
    if (n == 0).any():
        bad = torch.nonzero(n == 0).flatten()[:5].tolist()
        raise ValueError(f"candidates {bad} have no token positions in this part; cannot score them")
    fill = -INF if largest else INF
    v = values.double().masked_fill(~mask, fill).sort(dim=1, descending=largest).values
    csum = v.masked_fill_(~torch.isfinite(v), 0.0).cumsum(1)
    pct = torch.tensor([float(k) for k in ks], dtype=torch.float64)
    k = torch.clamp((n.double().unsqueeze(1) * pct / 100.0 + 1e-9).floor().long(), min=1)  # [N, len(ks)]
    means = csum.gather(1, k - 1) / k
    return {k_percent: means[:, j] for j, k_percent in enumerate(ks)}


def alpha_name(alpha: float) -> str:
    return "inf" if math.isinf(alpha) else f"{alpha:g}"


# ----------------------------------------------------------------------------------------------
# per-token signals of a language-model head


@dataclass
class PartSignals:
    """Per-token signals of one slice (``part``) for N candidates, padded to [N, T] with ``mask``."""

    mask: Tensor  # [N, T] bool
    entropy: dict[float, Tensor] = field(default_factory=dict)  # alpha -> [N, T]
    target_logprob: Tensor | None = None  # [N, T] log p(target) (None for target-free slices)
    mod_entropy: dict[float, Tensor] = field(default_factory=dict)  # alpha -> [N, T] (targets only)


def _encode_parts(out: Any, n: int) -> tuple[dict[str, Tensor], list] | None:
    """:func:`token_signals`' result as flat tensors ``<part index>/<field>`` and a layout naming the parts and the
    Rényi orders in order (JSON keeps floats and inf exactly); None for anything else (not spilled)."""
    if not isinstance(out, dict) or not all(isinstance(ps, PartSignals) for ps in out.values()):
        return None
    tensors: dict[str, Tensor] = {}
    layout = []
    for i, (part, ps) in enumerate(out.items()):
        fields = {"mask": ps.mask, **{f"H{j}": t for j, t in enumerate(ps.entropy.values())}}
        fields.update({f"M{j}": t for j, t in enumerate(ps.mod_entropy.values())})
        if ps.target_logprob is not None:
            fields["logprob"] = ps.target_logprob
        if any(t.device.type != "cpu" or t.shape[:1] != (n,) for t in fields.values()):
            return None
        tensors.update({f"{i}/{k}": t.contiguous() for k, t in fields.items()})
        layout.append([part, list(ps.entropy), list(ps.mod_entropy), ps.target_logprob is not None])
    return tensors, layout


def _decode_parts(tensors: dict[str, Tensor], layout: list, n: int) -> dict[str, PartSignals]:
    out = {}
    for i, (part, alphas, mod_alphas, has_target) in enumerate(layout):
        ps = PartSignals(
            mask=tensors[f"{i}/mask"], entropy={float(a): tensors[f"{i}/H{j}"] for j, a in enumerate(alphas)}
        )
        ps.mod_entropy = {float(a): tensors[f"{i}/M{j}"] for j, a in enumerate(mod_alphas)}
        ps.target_logprob = tensors[f"{i}/logprob"] if has_target else None
        if ps.mask.shape[:1] != (n,):
            raise ValueError(f"spilled per-token signals of {ps.mask.shape[0]} candidates, not {n}")
        out[str(part)] = ps
    return out


# [N, T] per-token statistics per slice: spilled like losses, so a killed MaxRényi cell resumes from its passes
PARTS_CODEC = Codec("part_signals", _encode_parts, _decode_parts)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode (no dropout, frozen batch-norm statistics) and restore it afterwards."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def length_sorted(api: TaskAPI, items: Sequence[Any]) -> tuple[Sequence[Any], Tensor | None]:
    """``items`` in the order of ``api.length`` (stable) and the index that puts per-item results back in the
    caller's order (``sorted_results[back]``), or (``items``, None) where the task has no item length.

    A text batch pads to its longest item: llm-text's default population in input order computes 1.31x the
    tokens it keeps (38,400 for 29,229 in batches of 16), sorted 1.007x. With right padding and causal
    attention a real token's output does not depend on the padding after it, so each item's signal is the
    same up to floating-point rounding (tests/test_signals.py)."""
    if api.length is None or len(items) < 2:
        return items, None
    length = api.length
    order = sorted(range(len(items)), key=lambda i: length(items[i]))
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return [items[i] for i in order], back


def batches(items: Sequence[Any], batch_size: int, desc: str) -> Iterator[Sequence[Any]]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, len(items), batch_size)
    for s in progress(starts, desc=desc, total=len(starts), leave=False):
        yield items[s : s + batch_size]


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot products of two [c, V] matrices, one BLAS dot per row: no [c, V] product is written
    (a multiply-then-sum pass cost 1.7x as much at 8 x 49k)."""
    if a.shape[0] == 0:
        return a.new_zeros(0)
    return torch.stack([torch.dot(x, y) for x, y in zip(a, b)])


class _Scratch:
    """Reused [rows, V] work buffers: a fresh multi-MB temporary per pass is mmap'd and page-faulted
    anew every time (issue 12: most of the former cost was system time)."""

    def __init__(self) -> None:
        self.bufs: dict[str, Tensor] = {}

    def get(self, name: str, like: Tensor) -> Tensor:
        b = self.bufs.get(name)
        if (
            b is None
            or b.shape[1] != like.shape[1]
            or b.shape[0] < like.shape[0]
            or b.dtype != like.dtype
            or b.device != like.device
        ):
            b = self.bufs[name] = torch.empty_like(like)
        return b[: like.shape[0]]


SERIES_BELOW = 5e-4  # p_j at most this: ModRényi's per-entry terms from their power series (module doc)
_BLOCK = 16


def _entries_above(e: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the entries of ``e`` [c, V] above the per-row ``tau`` [c] (few: at most 1 /
    ``SERIES_BELOW`` per row of probabilities), found through the maxima of ``nb`` groups of ``_BLOCK``
    strided columns: one vectorised max pass instead of a comparison and ``nonzero`` over every entry."""
    c, V = e.shape
    nb = V // _BLOCK
    found_r, found_c = [], []
    if nb:  # group j = columns j, j + nb, j + 2 nb, ...
        groups = e[:, : nb * _BLOCK].reshape(c, _BLOCK, nb)
        gr, gj = torch.nonzero(groups.amax(1) > tau.unsqueeze(1), as_tuple=True)
        if len(gr):
            r, k = torch.nonzero(groups[gr, :, gj] > tau[gr].unsqueeze(1), as_tuple=True)
            found_r.append(gr[r])
            found_c.append(k * nb + gj[r])
    if nb * _BLOCK < V:
        r, k = torch.nonzero(e[:, nb * _BLOCK :] > tau.unsqueeze(1), as_tuple=True)
        found_r.append(r)
        found_c.append(k + nb * _BLOCK)
    if not found_r:
        empty = torch.zeros(0, dtype=torch.long, device=e.device)
        return empty, empty
    return torch.cat(found_r), torch.cat(found_c)


def _token_rows(
    z: Tensor,
    tgt: Tensor | None,
    alphas: Sequence[float],
    mod_alphas: Sequence[float],
    work: _Scratch | None = None,
    *,
    rows: Tensor | None = None,
    chunk_rows: int = 8,
) -> dict[str, Tensor]:
    """Every per-position signal of the logits ``z`` [n, V] (or of its rows ``rows``) in about a dozen passes
    over the vocabulary, ``chunk_rows`` rows at a time (:func:`_chunk_sums`); the per-row arithmetic that
    follows runs once on all rows (:func:`_finish`), not once per chunk. Issue 12: 64 positions of a 49k
    vocabulary, one thread, cost 35 ms of CPU time against 48-51 ms before (small per-chunk operations,
    a sqrt pass and multiply-then-sum passes removed; ``tests/bench_signals.py``).

    ``zm = z - max``, ``e = exp zm`` computed as ``exp(zm / 2)^2`` (``exp(zm / 2) = sqrt e`` serves H_0.5;
    never normalised: p = e / s, s = sum e, log p = zm - log s); the
    Rényi entropies from row reductions (H_1 = log s - <e, zm> / s, H_2 = -log(sum e^2 / s^2),
    H_inf = log s, H_0.5 = 2 log(sum sqrt e / sqrt s)); the target's log-probability from its column;
    then, with the target's entries zeroed in place, ModRényi's sums over j != y of p log(1-p) (order 1),
    p (sqrt(1-p) - 1) (order 0.5 / 1.5) and p^2 (order 2) from the power series in p through p^3 (row
    sums of p^2 and p^3; truncation below 1e-7 relative for p <= ``SERIES_BELOW``) plus exact terms for
    the few larger entries: no transcendental pass for ModRényi. Same values as :func:`renyi_entropy`
    and :func:`modified_renyi_entropy` to float32 precision (tested).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for a in alphas:
        if a < 0:
            raise ValueError(f"Rényi order must be >= 0, got {a}")
    work = work if work is not None else _Scratch()
    n = len(rows) if rows is not None else z.shape[0]
    parts: dict[str, list[Tensor]] = {}
    for s in range(0, max(n, 1), chunk_rows):  # runs once on an empty selection too
        sel = rows[s : s + chunk_rows] if rows is not None else None
        zc = z.index_select(0, sel) if sel is not None else z[s : s + chunk_rows]
        t = tgt[s : s + chunk_rows] if tgt is not None else None
        for k, v in _chunk_sums(zc, t, alphas, mod_alphas, work, offset=s).items():
            parts.setdefault(k, []).append(v)
    return _finish({k: torch.cat(v) for k, v in parts.items()}, tgt is not None, alphas, mod_alphas)


def _chunk_sums(
    z: Tensor, tgt: Tensor | None, alphas: Sequence[float], mod_alphas: Sequence[float], work: _Scratch, *, offset: int
) -> dict[str, Tensor]:
    """The passes over the vocabulary of a chunk of rows ``z`` [c, V]: per-row sums (the module doc of
    :func:`_token_rows`) and the few off-target entries above ``SERIES_BELOW`` (row index + ``offset``)."""
    z = z.float()
    # h = zm / 2 (exact halving): sqrt(e) = exp(h) is the exponential pass, e its square (no sqrt pass)
    h = torch.add(z.amax(-1, keepdim=True).mul_(-0.5), z, alpha=0.5, out=work.get("h", z))
    r = torch.exp(h, out=work.get("r", z))
    e = torch.mul(r, r, out=work.get("e", z))
    out = {"s": e.sum(-1)}
    for a in alphas:
        if a == 1:
            out["e_zm"] = 2.0 * _rowdot(e, h)
        elif a == 0.5:
            out["sqrt_e"] = r.sum(-1)
        elif a != 2 and not math.isinf(a):
            out[f"lse{a}"] = torch.logsumexp((2.0 * a) * h, dim=-1)
    need2 = any(a == 2 for a in alphas)
    if tgt is None:
        if need2:
            out["q"] = _rowdot(e, e)
        return out
    idx = tgt.unsqueeze(-1)
    out["zm_y"] = 2.0 * h.gather(-1, idx).squeeze(-1)
    out["e_y"] = e.gather(-1, idx).squeeze(-1)
    if not (need2 or mod_alphas):
        return out
    e.scatter_(-1, idx, 0.0)  # off-target entries only from here on
    q = torch.mul(e, e, out=work.get("q", z))
    out["q_off"] = q.sum(-1)  # sum_{j != y} e_j^2
    if not mod_alphas:
        return out
    out["e3_off"] = _rowdot(q, e)
    r, c = _entries_above(e, SERIES_BELOW * out["s"])
    out["big_rows"], out["big_e"] = r + offset, e[r, c]
    for a in mod_alphas:
        ea = abs(1.0 - a)
        if a != 1 and ea not in (0.5, 1):  # no series: one pass per order
            p_off = e / out["s"].unsqueeze(-1)
            out[f"tail{a}"] = _rowdot(p_off, torch.expm1(ea * torch.log1p(-p_off.clamp(max=1 - 1e-12))))
    return out


def _finish(
    r: dict[str, Tensor], targets: bool, alphas: Sequence[float], mod_alphas: Sequence[float]
) -> dict[str, Tensor]:
    """The per-position signals from the row sums of :func:`_chunk_sums` (all rows at once)."""
    s = r["s"]
    log_s = s.log()
    out: dict[str, Tensor] = {}
    for a in alphas:
        if a == 1:
            out[f"H{a}"] = log_s - r["e_zm"] / s
        elif math.isinf(a):
            out[f"H{a}"] = log_s.clone()
        elif a == 2:  # sum e^2 = off-target + target: a sum of non-negative terms, no cancellation
            out[f"H{a}"] = (
                2 * log_s - (r["q_off"].double() + r["e_y"].double() ** 2).log().to(s.dtype)
                if targets
                else 2 * log_s - r["q"].log()
            )
        elif a == 0.5:
            out[f"H{a}"] = 2.0 * r["sqrt_e"].log() - log_s
        else:
            out[f"H{a}"] = (r[f"lse{a}"] - a * log_s) / (1.0 - a)
    if not targets:
        return out
    logpy = r["zm_y"] - log_s
    out["logprob"] = logpy
    if not mod_alphas:
        return out
    py = r["e_y"] / s
    s2, s3 = r["q_off"] / s**2, r["e3_off"] / s**3
    rows = r["big_rows"]
    big = (r["big_e"] / s[rows]).double()

    def tail(term, c2: float, c3: float) -> Tensor:
        """sum_{j != y} term(p_j) = -(c2 p^2 + c3 p^3 + ...): the series for every entry, exact on the large ones."""
        fix = (term(big) + c2 * big**2 + c3 * big**3).to(s.dtype)
        return -(c2 * s2 + c3 * s3) + torch.zeros_like(s2).index_add_(0, rows, fix)

    for a in mod_alphas:
        if a == 1:  # sum p log(1-p) = -sum p^2 + p^3/2 + ...
            t1 = tail(lambda v: v * torch.log1p(-v.clamp(max=1 - 1e-12)), 1.0, 0.5)
            out[f"M{a}"] = -(1 - py) * logpy - t1
            continue
        ea = abs(1.0 - a)
        head = (1 - py) * torch.expm1(ea * logpy)  # (1-p_y)(p_y^ea - 1)
        if ea == 1:  # alpha = 2 (or 0): (1-p_j) - 1 = -p_j
            t = -s2
        elif ea == 0.5:  # alpha = 0.5 or 1.5: sum p (sqrt(1-p) - 1) = -sum p^2/2 + p^3/8 + ...
            t = tail(lambda v: v * (torch.sqrt((1 - v).clamp(min=0)) - 1), 0.5, 0.125)
        else:
            t = r[f"tail{a}"]
        out[f"M{a}"] = -(head + t) / ea
    return out


def signal_names(alphas: Sequence[float], mod_alphas: Sequence[float], targets: bool) -> list[str]:
    return [f"H{a}" for a in alphas] + (["logprob"] + [f"M{a}" for a in mod_alphas] if targets else [])


def _pad(xs: list[Tensor]) -> Tensor:
    return pad_sequence(xs, batch_first=True) if xs else torch.zeros(0, 0)


@torch.no_grad()
def token_signals(
    api: TaskAPI,
    model: nn.Module,
    items: Sequence[Any],
    *,
    alphas: Sequence[float],
    mod_alphas: Sequence[float] = (),
    batch_size: int = 8,
    chunk_rows: int = 8,
    parts: Sequence[str] | None = None,
    desc: str = "signals",
    cache: SignalCache | None = None,
) -> dict[str, PartSignals]:
    """One forward pass per batch and part; per-token Rényi entropies, target log-probs, ModRényi.

    ``api.logits(model, batch, part)`` gives (logits [B,T,V], targets [B,T] or None, mask [B,T]); the
    statistics are computed in chunks of ``chunk_rows`` token positions (small: a chunk's few [c, V]
    temporaries stay in cache; 256 rows of a 49k vocabulary were 50 MB temporaries and page faults).
    With a ``cache`` (``obs.signals``) an identical earlier call (same model state, candidates, settings)
    is reused instead of recomputed. Only these per-token reductions are kept, never the logits.
    """
    if api.logits is None:
        raise ValueError(f"task {api.name!r} has no language-model head (api.logits)")
    parts = list(parts if parts is not None else (api.parts or ("text",)))
    if not alphas:
        raise ValueError("token_signals needs at least one Rényi order")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    kind = ("token_signals", tuple(parts), tuple(alphas), tuple(mod_alphas), batch_size)

    def compute() -> dict[str, PartSignals]:
        return _token_signals(
            api,
            model,
            items,
            alphas=alphas,
            mod_alphas=mod_alphas,
            batch_size=batch_size,
            chunk_rows=chunk_rows,
            parts=parts,
            desc=desc,
        )

    return cached(cache, kind, model, items, compute, PARTS_CODEC)


def _token_signals(
    api: TaskAPI,
    model: nn.Module,
    items: Sequence[Any],
    *,
    alphas: Sequence[float],
    mod_alphas: Sequence[float],
    batch_size: int,
    chunk_rows: int,
    parts: list[str],
    desc: str,
) -> dict[str, PartSignals]:
    if api.logits is None:
        raise ValueError("per-token signals need the task's language-model head (api.logits)")
    logits_of = api.logits
    rows: dict[str, dict[str, list[Tensor]]] = {p: {} for p in parts}
    has_tgt: dict[str, bool] = {}
    work = _Scratch()
    ordered, back = length_sorted(api, items)
    with eval_mode(model):
        for chunk in batches(ordered, batch_size, desc):
            batch = api.collate(list(chunk))
            for part in parts:
                logits, targets, mask = logits_of(model, batch, part)
                mask = mask.bool()
                if has_tgt.setdefault(part, targets is not None) != (targets is not None):
                    raise ValueError(f"api.logits part {part!r} returned targets for some batches only")
                counts = mask.sum(1).tolist()
                # the selected positions' rows, copied one chunk at a time (logits[mask] copied all B x T x V)
                flat = logits.reshape(-1, logits.shape[-1])
                pos = mask.reshape(-1).nonzero().squeeze(1).to(flat.device)
                ftgt = targets.reshape(-1)[pos].long() if targets is not None else None
                sel = None if len(pos) == len(flat) else pos  # every row: read the logits in place
                sig = _token_rows(flat, ftgt, alphas, mod_alphas, work, rows=sel, chunk_rows=chunk_rows)
                for k, v in sig.items():
                    rows[part].setdefault(k, []).extend(torch.split(v.cpu(), counts))
    out = {}
    for part in parts:
        r = {k: _in_order(rows[part].get(k, []), back) for k in signal_names(alphas, mod_alphas, True)}
        lengths = torch.tensor([len(x) for x in r[f"H{alphas[0]}"]], dtype=torch.long)
        T = int(lengths.max()) if len(lengths) else 0
        mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
        ps = PartSignals(mask=mask, entropy={a: _pad(r[f"H{a}"]) for a in alphas})
        if has_tgt.get(part):
            ps.target_logprob = _pad(r["logprob"])
            ps.mod_entropy = {a: _pad(r[f"M{a}"]) for a in mod_alphas}
        out[part] = ps
    return out


def _in_order(rows: list[Tensor], back: Tensor | None) -> list[Tensor]:
    """Per-item rows computed in :func:`length_sorted` order, back in the caller's order."""
    return rows if back is None or not rows else [rows[i] for i in back.tolist()]
