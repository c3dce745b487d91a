"""Round checkpoints of a training run: a kill, a crash or a session's end loses at most the round that was
running, and the resumed run is bit-for-bit the uninterrupted one (every random state the run draws from is
restored with it; ``bench check`` verifies this for every defense).

A checkpoint holds the simulator's whole state after a round (bench.fl.run_federated, ``kind="round"``): the global
state and buffers, each client's private state and latest message, the transcript and logs, the defense's run state
(server optimisers' state dicts) and the torch / NumPy / Python random states with the run's generator. It is
written atomically beside the run's cache entry (``<cache>/train/<key>.ckpt``) once at least ``every_s`` seconds
have passed since the run started or last saved (``BENCH_CHECKPOINT_S``, default 120 s, so short runs never write
one), and deleted when the run finishes. It holds plain data only (tensors, numbers, strings, lists, tuples, dicts)
and is read with ``torch.load(weights_only=True)``, so like every cache it never unpickles code; an object in a
defense's state is saved as its ``state_dict()`` and restored into the object ``Defense.start_run`` made afresh. A
central run is one round of many epochs: its training loop saves after an epoch instead (``kind="epoch"``: the
trained parameters, the optimiser, the loop's own state and position; the central LDM LoRA defenses'
``defenses/_lora_common.lora_loop``), reached through ``RoundCtx.checkpoint``.
"""

from __future__ import annotations

import io
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .store import atomic_write_bytes

FORMAT = 1
ENV = "BENCH_CHECKPOINT_S"
DEFAULT_EVERY_S = 120.0


def interval() -> float:
    """Seconds between checkpoints: ``BENCH_CHECKPOINT_S`` (0: after every round), else 120."""
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_EVERY_S
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds (e.g. 120; 0 saves after every round)") from None
    if value < 0:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 seconds")
    return value


def random_states() -> dict[str, Any]:
    """Every process-wide random state a training run may draw from (as plain data)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # noqa: NPY002
    numpy = (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss))
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": numpy, "python": random.getstate()}


def restore_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))  # noqa: NPY002
    random.setstate(states["python"])


STATEFUL = "__state_dict__"  # marks an object saved as its state_dict()


def to_plain(x: Any, where: str = "state") -> Any:
    """``x`` as plain data a weights-only load reads back; an object with ``state_dict()`` becomes
    ``{STATEFUL: its state dict}``. Anything else is a TypeError naming where it sits."""
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor)):
        return x.detach() if isinstance(x, torch.Tensor) else x
    if isinstance(x, dict):
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    if callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None)):
        return {STATEFUL: to_plain(x.state_dict(), f"{where}.state_dict()")}
    raise TypeError(
        f"{where}: a {type(x).__name__} cannot be checkpointed: keep tensors, numbers, strings, lists, tuples and "
        "dicts in ClientState.private and DefenseRun.state, or objects with state_dict() / load_state_dict()"
    )


def from_plain(saved: Any, fresh: Any, where: str = "state") -> Any:
    """Undo :func:`to_plain`: a saved state dict is loaded into the matching object of ``fresh`` (the same
    structure as made anew, e.g. by ``Defense.start_run``)."""
    if isinstance(saved, dict) and set(saved) == {STATEFUL}:
        if not callable(getattr(fresh, "load_state_dict", None)):
            raise ValueError(f"{where}: a saved object's state but no object to load it into (make it in start_run)")
        fresh.load_state_dict(saved[STATEFUL])
        return fresh
    if isinstance(saved, dict):
        own = fresh if isinstance(fresh, dict) else {}
        return {k: from_plain(v, own.get(k), f"{where}[{k!r}]") for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        own_seq = fresh if isinstance(fresh, (list, tuple)) and len(fresh) == len(saved) else [None] * len(saved)
        return type(saved)(from_plain(v, f, f"{where}[{i}]") for i, (v, f) in enumerate(zip(saved, own_seq)))
    return saved


def restored_share(path: Path) -> float:
    """The share of its run the checkpoint at ``path`` holds, for a plan's estimate: ``next_round / rounds`` after a
    round, ``(round + epoch / epochs) / rounds`` after an epoch of a central run (the totals saved with it); 0
    when there is none, or one the run would not use (:meth:`Checkpoint.load` would delete it) or that predates
    the saved totals. Read memory-mapped: planning never reads the state's tensors (vlm-caption's are ~100 MB)."""
    try:
        blob = torch.load(path, weights_only=True, mmap=True)
        state = blob["state"] if blob.get("format") == FORMAT and blob.get("key") == path.stem else {}
        if state.get("kind") == "round":
            done = float(state["next_round"])
        elif state.get("kind") == "epoch":
            done = float(state["round"]) + float(state["epoch"]) / max(1, int(state["epochs"]))
        else:
            return 0.0
        return min(max(done / max(1, int(state["rounds"])), 0.0), 1.0)
    except Exception:  # noqa: BLE001 - none, unreadable or without totals: counted as a run from its first round
        return 0.0


def path_for(stem: Path) -> Path:
    """The checkpoint file of the run whose cache entry is ``stem`` (bench/cachefile.py): ``<stem>.ckpt``."""
    return stem.with_name(stem.name + ".ckpt")


@dataclass
class Checkpoint:
    """The checkpoint file of one training run (``key``: its training key; another run's file is ignored)."""

    path: Path
    key: str
    every_s: float = field(default_factory=interval)
    unsaved: str = field(default="", init=False)  # why this run cannot be checkpointed ("": it can)
    _last: float = field(default_factory=time.monotonic, init=False, repr=False)

    def due(self, *, last: bool) -> bool:
        """Save now? Never after the last round or epoch (the result is cached instead)."""
        return not last and time.monotonic() - self._last >= self.every_s

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` (the simulator's, after a round) with the process's random states, atomically. State
        that cannot be checkpointed ends checkpointing for this run with a warning (``unsaved`` says why)."""
        try:
            plain = to_plain(state)
        except TypeError as e:
            print(f"warning: no round checkpoints for this run: {e}", file=sys.stderr)  # noqa: T201
            self.unsaved, self.every_s = str(e), math.inf
            return
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "key": self.key, "state": plain, "random": random_states()}, buf)
        atomic_write_bytes(self.path, buf.getvalue())
        self._last = time.monotonic()

    def load(self, **match: Any) -> dict[str, Any] | None:
        """The saved state when its items equal ``match`` (e.g. ``kind="round"``; random states restored), else
        None: no checkpoint, one saved elsewhere in the run (left for the loop it belongs to), or one that
        cannot be used (deleted, with a warning naming why: the run starts from its first round)."""
        if not self.path.exists():
            return None
        try:
            blob = torch.load(self.path, weights_only=True)
            if not isinstance(blob, dict) or blob.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} checkpoint")
            if blob.get("key") != self.key:
                raise ValueError(f"it belongs to training run {blob.get('key')!r}")
            state = blob["state"]
            if any(state.get(k) != v for k, v in match.items()):
                return None
            restore_random_states(blob["random"])
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint means: train from the start
            print(  # noqa: T201
                f"warning: checkpoint {self.path.name} not used ({type(e).__name__}: {e}); training from round 1",
                file=sys.stderr,
            )
            self.clear()
            return None
        self._last = time.monotonic()
        return state

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
