"""Per-training-run state, created by the harness so that defense configs stay immutable.

A defense dataclass is a configuration: one instance is crossed with every task of a run (``--preset
paper`` across scenarios). Anything that depends on the task or accumulates during training (the DP
delta, a server optimiser's state) therefore lives in a :class:`~bench.types.DefenseRun` made here once
per (task, defense, seed) and handed to the defense on every :class:`~bench.types.RoundCtx`.
"""

from __future__ import annotations

from .types import Defense, DefenseRun, RoundCtx, TaskSpec

DEFAULT_DELTA = 1e-5  # used when neither the defense nor the scenario fixes one


def resolve_delta(defense: Defense, task: TaskSpec | None) -> float:
    """The DP delta of a run: the defense's configured ``dp_delta()``, else the scenario's
    ``task.dp_delta``, else 1e-5. The harness records this value beside the epsilons."""
    own = defense.dp_delta()
    if own is not None:
        return float(own)
    scenario = task.dp_delta if task is not None else None
    return float(DEFAULT_DELTA if scenario is None else scenario)


def new_run(defense: Defense, task: TaskSpec | None, *, seed: int = 0) -> DefenseRun:
    """A fresh run state for ``defense`` on ``task`` (None: no scenario delta), filled by ``defense.start_run``."""
    run = DefenseRun(delta=resolve_delta(defense, task), seed=int(seed))
    defense.start_run(run)
    return run


def run_of(defense: Defense, ctx: RoundCtx) -> DefenseRun:
    """The run state a round belongs to. A context built without one (a lone probe round, a unit test)
    gets a fresh one, kept on the context so the client step and the aggregation of that round share it."""
    if ctx.run is None:
        ctx.run = new_run(defense, ctx.task if isinstance(ctx.task, TaskSpec) else None)
    return ctx.run
