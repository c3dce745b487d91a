"""Cache entries as safetensors (tensors) + JSON (metadata and the tensor file's SHA-256); no pickle.

An entry ``<stem>.json`` names its tensor file ``<stem>-<sha12>.safetensors`` and holds its size and
SHA-256. The tensor file is written first and the JSON last (both atomically), so the JSON is the commit:
a kill between the two leaves a stray tensor file and a cache miss, never a torn entry. Loading reads the
bytes once, checks size and checksum, and parses them with safetensors (which cannot run code). An entry
that fails any check is moved to a quarantine folder with the reason (never deleted) and reported; the
caller rebuilds it. Legacy torch pickles (``<stem>.pt``) are read with ``weights_only=True`` only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .store import atomic_write_bytes, quarantine

FORMAT = 1
_TENSOR_FILE = re.compile(r"^[A-Za-z0-9_.-]+-[0-9a-f]{12}\.safetensors$")

Entry = tuple[dict[str, Tensor], dict[str, Any]]
T = TypeVar("T")


_LOCKED = {"s": 0.0, "depth": 0}  # this process's seconds inside file_lock, and how deep it is now


def locked_s() -> float:
    """Seconds this process has spent inside :func:`file_lock`: waiting for a shared entry another worker builds,
    building it (the one-off preparations of bench.preparations: the VLM's projector alignment, the latent
    diffusion base) or loading it. A unit leaves them out of its own cost (bench.units), so an estimate learned
    from the unit that happened to come first on a fresh machine is not 40 minutes too long."""
    return _LOCKED["s"]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created), so concurrent workers build a shared entry only once;
    the time inside it counts towards :func:`locked_s` (nested locks once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _LOCKED["depth"] += 1
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        _LOCKED["depth"] -= 1
        if not _LOCKED["depth"]:
            _LOCKED["s"] += time.monotonic() - t0


class CacheDamaged(Exception):
    """A cache entry exists but cannot be trusted (unreadable, truncated, checksum mismatch, not ours)."""


def _json_default(o: Any) -> Any:
    """Numbers and arrays a defense may put in its message meta or logs (torch / numpy) as JSON values."""
    if isinstance(o, Tensor):
        return o.detach().cpu().tolist()
    if hasattr(o, "tolist"):  # numpy arrays and scalars
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def _plain(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses shared memory)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def quarantine_for(folder: Path) -> Path:
    """Where the damaged entries of the cache folder ``<out>/cache/<name>`` go: ``<out>/quarantine/cache/<name>``."""
    return folder.parent.parent / "quarantine" / folder.parent.name / folder.name


def _head(stem: Path) -> Path:
    """The entry's JSON (its commit record)."""
    return stem.parent / f"{stem.name}.json"


def save(stem: Path, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Path:
    """Write the entry ``stem`` (tensor file first, JSON commit last); returns the JSON path. Rewriting an entry (a
    checkpoint saved every few steps) removes the tensor file the new commit replaces, so none piles up."""
    body = json.dumps({"format": FORMAT, "meta": meta}, default=_json_default)  # fail before writing anything
    data = st_save(_plain(tensors))
    digest = hashlib.sha256(data).hexdigest()
    tensor_name = f"{stem.name}-{digest[:12]}.safetensors"
    before = head(stem)
    atomic_write_bytes(stem.parent / tensor_name, data)
    entry = json.loads(body)
    entry.update(tensors=tensor_name, sha256=digest, nbytes=len(data))
    path = _head(stem)
    atomic_write_bytes(path, json.dumps(entry, indent=1, default=_json_default).encode())
    old = before.get("tensors") if before is not None else None
    if isinstance(old, str) and old != tensor_name and _TENSOR_FILE.match(old):  # never a path outside the folder
        (stem.parent / old).unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def building(stem: Path) -> Iterator[None]:
    """Hold ``<stem>.lock`` exclusively (``flock``) while building the entry ``stem``: a second process (another run
    on the same ``--out``) building the same entry waits, then finds it cached instead of training it again and
    overwriting the first one's checkpoints. The kernel drops the lock when its holder dies (kill -9 included).
    The holder removes the file before it lets go, so none stays beside the entry; a waiter that then holds a
    removed file's lock starts over on the path's current file. Where ``fcntl`` is missing (Windows) nothing is
    locked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX only
        yield
        return
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.parent / f"{stem.name}.lock"
    while True:
        f = open(path, "a+b")  # noqa: SIM115 - held open across the yield, closed below
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:  # its holder removed it while this one waited
            pass
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it: a waiter on this file starts over
        f.close()


def head(stem: Path) -> dict[str, Any] | None:
    """The entry's parsed JSON (metadata and its tensors' SHA-256) without reading the tensors; None when absent
    or unreadable (the loaders check the tensors)."""
    try:
        out = json.loads(_head(stem).read_bytes())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) and isinstance(out.get("meta"), dict) else None


def _read(stem: Path) -> tuple[Entry, list[Path]]:
    """The entry's tensors and metadata; raises CacheDamaged naming the problem (and the files involved)."""
    path = _head(stem)
    files = [path]
    try:
        head = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise CacheDamaged(f"{path.name}: unreadable metadata ({type(e).__name__}: {e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or not isinstance(head.get("meta"), dict):
        raise CacheDamaged(f"{path.name}: not a format-{FORMAT} cache entry")
    name, digest, nbytes = head.get("tensors"), head.get("sha256"), head.get("nbytes")
    if not (isinstance(name, str) and _TENSOR_FILE.match(name) and isinstance(digest, str) and isinstance(nbytes, int)):
        raise CacheDamaged(f"{path.name}: malformed tensor reference {name!r}")
    tpath = stem.parent / name
    files.append(tpath)
    try:
        data = tpath.read_bytes()
    except OSError as e:
        raise CacheDamaged(f"{name}: unreadable tensor file ({type(e).__name__}: {e})") from None
    if len(data) != nbytes:
        raise CacheDamaged(f"{name}: {len(data)} bytes, the metadata says {nbytes} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CacheDamaged(f"{name}: SHA-256 mismatch (damaged or replaced)")
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own SafetensorError on a malformed file
        raise CacheDamaged(f"{name}: not a safetensors file ({type(e).__name__}: {e})") from None
    return (tensors, head["meta"]), files


def _quarantine_entry(stem: Path, files: list[Path], quarantine_dir: Path, why: str) -> None:
    head = _head(stem)
    if len(files) == 1:  # add the tensor file the JSON names, when it is intact enough to say
        try:
            name = json.loads(head.read_bytes()).get("tensors")
            if isinstance(name, str) and _TENSOR_FILE.match(name):
                files = [*files, stem.parent / name]
        except (OSError, ValueError, AttributeError):
            pass
    quarantine(files, quarantine_dir, f"damaged cache entry, rebuilt: {why}")


def verify(stem: Path, *, quarantine_dir: Path | None) -> bool:
    """True when the entry ``stem`` exists and passes the size / checksum / safetensors checks; a damaged
    one is quarantined (False). For planners: the entry's loader then finds it absent and rebuilds it.
    ``quarantine_dir`` None (a dry run): a damaged entry is reported and left in place."""
    if not _head(stem).exists():
        return False
    try:
        _read(stem)
        return True
    except CacheDamaged as e:
        if quarantine_dir is None:
            print(f"damaged cache entry {_head(stem)} (left in place): {e}", file=sys.stderr)  # noqa: T201
        else:
            _quarantine_entry(stem, [_head(stem)], quarantine_dir, str(e))
        return False


def load(
    stem: Path,
    decode: Callable[[dict[str, Tensor], dict[str, Any]], T],
    *,
    quarantine_dir: Path,
    legacy: tuple[Path, Callable[[Any], Entry]] | None = None,
) -> T | None:
    """``decode(tensors, meta)`` of the entry ``stem``, or None when there is none or it is damaged (then it
    is quarantined into ``quarantine_dir`` and the caller rebuilds it; a ``decode`` that raises counts as
    damage too). ``legacy`` = (a former torch file, a converter of its loaded object to (tensors, meta)):
    read with ``weights_only=True`` only, and rewritten in this format (the old file stays in place)."""
    head = _head(stem)
    if head.exists():
        files = [head]
        try:
            (tensors, meta), files = _read(stem)
            return decode(tensors, meta)
        except Exception as e:  # CacheDamaged from the checks, or a layout decode cannot use
            why = str(e) if isinstance(e, CacheDamaged) else f"{type(e).__name__}: {e}"
            _quarantine_entry(stem, files, quarantine_dir, why)
            return None
    if legacy is not None and legacy[0].exists():
        old, convert = legacy
        try:
            blob = torch.load(old, map_location="cpu", weights_only=True)
            tensors, meta = convert(blob)
            value = decode(tensors, meta)
        except Exception as e:  # an unpickling refusal (planted code), truncation, or an unexpected layout
            quarantine(
                [old],
                quarantine_dir,
                f"legacy torch cache not loadable with weights_only=True, rebuilt: {type(e).__name__}: {e}",
            )
            return None
        save(stem, tensors, meta)
        return value
    return None


def flatten(groups: Mapping[str, Mapping[str, Tensor]]) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """``{group: {name: tensor}}`` -> ``{"group/name": tensor}`` plus each group's key order (kept in the
    metadata: safetensors stores tensors in its own order)."""
    flat, order = {}, {}
    for g, d in groups.items():
        order[g] = list(d)
        for n, t in d.items():
            flat[f"{g}/{n}"] = t
    return flat, order


def unflatten(flat: Mapping[str, Tensor], order: Mapping[str, list[str]]) -> dict[str, dict[str, Tensor]]:
    """Inverse of :func:`flatten`; raises CacheDamaged when a listed tensor is missing."""
    try:
        return {g: {n: flat[f"{g}/{n}"] for n in names} for g, names in order.items()}
    except KeyError as e:
        raise CacheDamaged(f"tensor {e.args[0]!r} listed in the metadata is missing") from None
