"""Cache of per-(model, candidate) membership signals, shared by the attacks of one cell group.

Score-based attacks of the same (task, defense, seed) score the same candidates with the same model:
the loss attack's threshold and proxy methods, the grid variants of MaxRényi, the base-model shift check
in every view. The first computes the per-token statistics (or losses, or per-sample gradient norms) and
the others reuse them. Keys are content hashes, never object identities: the model's key hashes its state
(every parameter and buffer), a candidate's key its tensors / values, so a changed model or item is never
served a stale signal. Only reductions are kept (per-token statistics, not logits). In memory:
:func:`group_cache` keeps the current group's cache and drops it when the next group starts. On disk (with a
``spill`` folder, the harness's ``<cache>/signals``): every signal its :class:`Codec` can write (losses: one CPU
tensor per candidate; gradient norms and MaxRényi's per-token statistics through the codecs of bench.loss_signals
and bench.signals) is also written as a checksummed safetensors entry (bench/cachefile.py, no pickle), so a cell
killed part-way ([RMIA]'s client cell on vlm-caption scores ~40 model passes in ~1 h) resumes from its finished
passes, and another worker or node sharing ``--out`` reads them instead of recomputing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from . import cachefile
from .progress import restored_step, saved_step
from .store import atomic_write_bytes

# bump when a signal's computation changes (bench/loss_signals.py): entries spilled before are then never read
SPILL_VERSION = 1


def _feed(h: Any, obj: Any) -> None:  # h: a hashlib hash
    if isinstance(obj, Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(_tensor_bytes(obj))
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"D")
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    elif obj is None or isinstance(obj, (str, int, float, bool, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:  # e.g. a PIL image: its pixels and size
        tobytes = getattr(obj, "tobytes", None)
        if not callable(tobytes):
            raise TypeError(f"cannot fingerprint a candidate of type {type(obj).__name__}")
        h.update(f"O{type(obj).__name__}{getattr(obj, 'size', '')}{getattr(obj, 'mode', '')}".encode())
        h.update(tobytes())


def fingerprint(obj: Any) -> str:
    """A content hash of a candidate (nested tuples / lists / dicts of tensors, arrays and scalars)."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, obj)
    return h.hexdigest()


def _tensor_bytes(t: Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12, so mypy at 3.10 misses the buffer protocol
    return memoryview(np.ascontiguousarray(t.numpy())).cast("B")  # type: ignore[arg-type]


def model_fingerprint(model: nn.Module) -> str:
    """A content hash of a model's state: every parameter and buffer's name, dtype, shape and the CRC-32
    of its bytes (zlib's CRC runs ~5x faster than a cryptographic hash over hundreds of MB of weights;
    a stale hit would need every differing tensor's CRC to collide)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__qualname__.encode())
    for name, t in model.state_dict(keep_vars=False).items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{zlib.crc32(_tensor_bytes(t))}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Codec:
    """How a signal result goes to the spill folder and back: ``encode(out, n)`` gives (tensors, a JSON layout), or
    None where ``out`` is not one this codec writes (it stays in memory); ``decode(tensors, layout, n)`` rebuilds it
    and raises on a layout it cannot use (the entry is then quarantined and recomputed)."""

    name: str
    encode: Callable[[Any, int], tuple[dict[str, Tensor], Any] | None]
    decode: Callable[[dict[str, Tensor], Any, int], Any]


def _encode_one_tensor(out: Any, n: int) -> tuple[dict[str, Tensor], Any] | None:
    if isinstance(out, Tensor) and out.device.type == "cpu" and out.shape[:1] == (n,):
        return {"signal": out.detach().contiguous()}, None
    return None


def _decode_one_tensor(tensors: dict[str, Tensor], layout: Any, n: int) -> Tensor:
    t = tensors["signal"]
    if t.shape[:1] != (n,):
        raise ValueError(f"a spilled signal of {tuple(t.shape)} for {n} candidates")
    return t


# one CPU tensor with one row per candidate (per-sample losses): the default
PER_CANDIDATE = Codec("per_candidate", _encode_one_tensor, _decode_one_tensor)


class SignalCache:
    """Signal results by (signal kind, model state hash, the candidates' hashes in order): in memory, and with a
    ``spill`` folder on disk too (the results its :class:`Codec` can write; see the module docstring).

    A whole call is the unit (not a single candidate): a batched forward pass can differ in the last bits
    with the batch's composition (padding, GEMM blocking) and seeded randomness (diffusion noise) is drawn
    per call, so a hit returns exactly what recomputing would, and records are the same whether or not
    cells share a process (``--jobs``) or a spilled entry is read. ``kind`` names the signal and every setting
    it depends on (orders, timesteps, batch size, seed). The model hash is memoised per model object as long as
    the model is not modified in place (the harness never does; :meth:`forget_model` drops the memo). Results
    are shared between callers: treat them as read-only."""

    def __init__(self, spill: Path | None = None) -> None:
        self._results: dict[tuple[Hashable, str, tuple[str, ...]], Any] = {}
        self._models: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.spill = spill
        self.hits = 0
        self.misses = 0
        self.uncached = 0
        self.loaded = 0  # hits read from the spill folder (counted in ``hits`` too)

    def __len__(self) -> int:
        return len(self._results)

    def model_key(self, model: nn.Module) -> str:
        key = self._models.get(model)
        if key is None:
            key = self._models[model] = model_fingerprint(model)
        return key

    def forget_model(self, model: nn.Module) -> None:
        self._models.pop(model, None)

    def get(
        self,
        kind: Hashable,
        model: nn.Module,
        items: Sequence[Any],
        compute: Callable[[], Any],
        codec: Codec = PER_CANDIDATE,
    ) -> Any:
        """The cached result of this (kind, model, candidates) call, else ``compute()`` stored for the next
        (spilled through ``codec``). Candidates of a type :func:`fingerprint` cannot hash are computed every time
        (``uncached`` counts them): never shared, never wrong."""
        try:
            fps = tuple(fingerprint(it) for it in items)
        except TypeError:
            self.uncached += 1
            return compute()
        key = (kind, self.model_key(model), fps)
        if key in self._results:
            self.hits += 1
            TOTALS["reused"] += 1
            restored_step()  # computed earlier (another cell, or the z pass again): instant, out of the bar's rate
            return self._results[key]
        if (on_disk := self._load(key, codec)) is not None:
            self.hits += 1
            self.loaded += 1
            TOTALS["reused"] += 1
            TOTALS["loaded"] += 1
            self._results[key] = on_disk
            restored_step()  # done before this run: on the run's bar, out of its rate
            return on_disk
        self.misses += 1
        TOTALS["computed"] += 1
        out = self._results[key] = compute()
        self._save(key, out, codec)
        return out

    @staticmethod
    def _stem(spill: Path, key: tuple[Hashable, str, tuple[str, ...]]) -> Path:
        kind, model_key, fps = key
        h = hashlib.blake2b(f"{SPILL_VERSION}|{kind!r}|{model_key}|{','.join(fps)}".encode(), digest_size=16)
        name = h.hexdigest()
        return spill / name[:2] / name

    def _load(self, key: tuple[Hashable, str, tuple[str, ...]], codec: Codec) -> Any:
        """The spilled result of ``key``, or None (none, or damaged: quarantined beside the cache, recomputed)."""
        if self.spill is None:
            return None
        n = len(key[2])

        def decode(tensors: dict[str, Tensor], meta: dict[str, Any]) -> Any:
            # entries of the first spill format carry no codec name: one tensor per candidate
            if (
                meta.get("version") != SPILL_VERSION
                or meta.get("n") != n
                or meta.get("codec", PER_CANDIDATE.name) != codec.name
            ):
                raise ValueError(f"a spilled signal of another layout: {meta}")
            return codec.decode(tensors, meta.get("layout"), n)

        stem = self._stem(self.spill, key)
        return cachefile.load(stem, decode, quarantine_dir=cachefile.quarantine_for(self.spill))

    def _save(self, key: tuple[Hashable, str, tuple[str, ...]], out: Any, codec: Codec) -> None:
        """Spill a result ``codec`` can write; a failed write warns and costs only a recomputation later."""
        if self.spill is None or (encoded := codec.encode(out, len(key[2]))) is None:
            return
        tensors, layout = encoded
        stem = self._stem(self.spill, key)
        meta = {"version": SPILL_VERSION, "codec": codec.name, "layout": layout, "kind": repr(key[0])}
        meta.update(model=key[1], n=len(key[2]))
        try:
            cachefile.save(stem, tensors, meta)
        except (OSError, ValueError, TypeError) as e:
            print(f"warning: signal not spilled to {stem}: {type(e).__name__}: {e}", file=sys.stderr)  # noqa: T201
        else:
            saved_step()  # the cell's done fraction so far, for a later run's plan (write_marker)


def marker_path(cache_root: Path, cell_id: str) -> Path:
    """Where a running cell keeps the done fraction its spilled passes hold (``<cache>/signals/cells``)."""
    return cache_root / "signals" / "cells" / f"{cell_id}.json"


def write_marker(path: Path, fraction: float) -> None:
    """Keep ``fraction`` (a cell's share done, its passes spilled) for :func:`spilled_share`; a failed write only
    leaves a plan's estimate higher."""
    try:
        atomic_write_bytes(path, json.dumps({"fraction": round(float(fraction), 6)}).encode())
    except OSError as e:
        print(f"warning: progress marker not written to {path}: {e}", file=sys.stderr)  # noqa: T201


def spilled_share(path: Path) -> float:
    """The share of a killed cell its spilled passes hold (0: none, unreadable); the plan counts it as done
    before the run, as it counts a training run's round checkpoint (bench.checkpoint.restored_share)."""
    try:
        f = float(json.loads(path.read_bytes())["fraction"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return min(max(f, 0.0), 1.0)


def cached(
    cache: SignalCache | None,
    kind: Hashable,
    model: nn.Module,
    items: Sequence[Any],
    compute: Callable[[], Any],
    codec: Codec = PER_CANDIDATE,
) -> Any:
    """``cache.get(...)``, or ``compute()`` when there is no cache."""
    return compute() if cache is None else cache.get(kind, model, items, compute, codec)


_CURRENT: dict[str, Any] = {"group": None, "cache": None}
# signal calls served from a cache / computed and stored, over every cache of this process: a cell's record
# carries its own share (bench.units: cost.signals_reused / signals_computed; bench.runplan learns from them)
# (loaded: those of the reused read back from the spill folder, e.g. by a cell resumed after a kill)
TOTALS = {"reused": 0, "computed": 0, "loaded": 0}


def group_cache(group: Hashable, spill: Path | None = None) -> SignalCache:
    """The cache of cell group ``group`` (e.g. (task id, defense config, seed)) spilling to ``spill``: the same
    object while consecutive cells belong to the group; a new empty one (the old one dropped) when it changes."""
    if _CURRENT["group"] != (group, spill) or _CURRENT["cache"] is None:
        _CURRENT["group"], _CURRENT["cache"] = (group, spill), SignalCache(spill)
    return _CURRENT["cache"]
