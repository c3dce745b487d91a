"""One-off preparations: cached builds a scenario's tasks need before their first cell can run (the VLM's aligned
projector, the latent-diffusion base), made once per machine by whichever unit needs them first.

A scenario module may define ``preparations(preset) -> list[Preparation]``: what it builds, the cache entry it
writes (a :mod:`bench.cachefile` stem, from the same key function its loader uses) and the seconds it took on one
worker thread here. The plan (bench.runplan) counts the pending ones in its estimate and names them, so a first
run on a fresh machine is not estimated as if they were cached. Builds under a minute are not declared.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True)
class Preparation:
    """A cached build: ``what`` it is, the task ids that need it, its cache entry ``stem`` and its estimated
    ``seconds`` on one worker thread (measured here, stated where the scenario declares it)."""

    what: str
    tasks: tuple[str, ...]
    stem: Path
    seconds: float

    def cached(self) -> bool:
        """Whether its entry is there (its metadata; the loader checks the tensors and rebuilds a damaged one)."""
        from . import cachefile

        return cachefile.head(self.stem) is not None


def declared(scenario: str, preset: str) -> list[Preparation]:
    """The preparations the scenario module registered as ``scenario`` declares at ``preset`` (none when it
    declares none)."""
    from .registry import SCENARIOS

    if scenario not in SCENARIOS.names():  # e.g. a test's made-up task
        return []
    builder = SCENARIOS.get(scenario)
    fn = getattr(sys.modules.get(getattr(builder, "__module__", ""), None), "preparations", None)
    return list(fn(preset)) if callable(fn) else []


def pending(tasks: Iterable[tuple[str, str]]) -> list[Preparation]:
    """The uncached preparations of the given (task id, preset) pairs, each once."""
    wanted = sorted(set(tasks))
    out: dict[Path, Preparation] = {}
    for preset in sorted({p for _, p in wanted}):
        ids = {t for t, p in wanted if p == preset}
        for scenario in sorted({t.split("/", 1)[0] for t in ids}):
            for prep in declared(scenario, preset):
                if prep.stem not in out and ids.intersection(prep.tasks) and not prep.cached():
                    out[prep.stem] = prep
    return list(out.values())
