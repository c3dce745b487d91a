"""Per-training-run state, created by the harness so that defense configs stay immutable.

A defense dataclass is a configuration: one instance is crossed with every task of a run (``--preset
paper`` across scenarios). Anything that depends on the task or accumulates during training (the DP
delta, a server optimiser's state) therefore lives in a :class:`~bench.types.DefenseRun` made here once
per (task, defense, seed) and handed to the defense on every :class:`~bench.types.RoundCtx`.
"""
from __future__ import annotations

from typing import Any, Mapping

from .types import Defense, DefenseRun, RoundCtx

DEFAULT_DELTA = 1e-5  # used when neither the defense nor the scenario fixes one


def resolve_delta(defense: Defense, info: Mapping[str, Any] | None) -> float:
    """The DP delta of a run: the defense's configured ``dp_delta()``, else the scenario's
    ``info["dp_delta"]``, else 1e-5. The harness records this value beside the epsilons."""
    own = defense.dp_delta()
    if own is not None:
        return float(own)
    return float((info or {}).get("dp_delta", DEFAULT_DELTA))


def new_run(defense: Defense, info: Mapping[str, Any] | None, *, seed: int = 0) -> DefenseRun:
    """A fresh run state for ``defense`` on a task with scenario ``info``, filled by ``defense.start_run``."""
    run = DefenseRun(delta=resolve_delta(defense, info), seed=int(seed))
    defense.start_run(run)
    return run


def run_of(defense: Defense, ctx: RoundCtx) -> DefenseRun:
    """The run state a round belongs to. A context built without one (a lone probe round, a unit test)
    gets a fresh one, kept on the context so the client step and the aggregation of that round share it."""
    if ctx.run is None:
        ctx.run = new_run(defense, getattr(ctx.task, "info", None))
    return ctx.run
