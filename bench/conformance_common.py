"""What the conformance checks share (:mod:`bench.conformance` for defenses and the command, :mod:`bench.
conformance_attack` for attacks): the report, the smoke task a method is checked on, and the static checks of its
hyper-parameters (typed fields, ranges, grid, declared task fields, an attack's budget caps)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Callable, Mapping, Sequence

from .params import describe_field, range_of
from .registry import SCENARIOS, UsageError, build, parse_value
from .task import Task
from .types import TaskAPI

ROUNDS = 2
MAX_LOCAL_STEPS = 1
CLIENTS_PER_ROUND = 2
PREFERRED = ("image-cls", "llm-text", "vlm-caption", "ldm-t2i")  # cheapest smoke scenarios first


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | WARN | SKIP
    detail: str = ""


@dataclass
class Report:
    subject: str
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool | None, detail: str = "", *, warn_only: bool = False) -> None:
        status = "SKIP" if ok is None else "PASS" if ok else ("WARN" if warn_only else "FAIL")
        self.checks.append(Check(name, status, detail))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def render(self) -> str:
        lines = [f"bench check: {self.subject}"]
        lines += [f"  {c.status:4s}  {c.name:18s} {c.detail}" for c in self.checks]
        n = len(self.failed)
        lines.append(f"  result: {'all checks passed' if not n else f'{n} check(s) failed'}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# tasks


@cache
def smoke_tasks(scenario: str) -> tuple[Task, ...]:
    return tuple(SCENARIOS.get(scenario)("smoke"))


def scenario_order() -> list[str]:
    names = SCENARIOS.names()
    return [n for n in PREFERRED if n in names] + [n for n in names if n not in PREFERRED]


def shrink(task: Task, rounds: int = ROUNDS, steps: int = MAX_LOCAL_STEPS, clients: int = CLIENTS_PER_ROUND) -> Task:
    """The task with a few rounds, clients per round and local steps: a conformance run, not a benchmark."""
    cap = steps if task.fl.max_local_steps is None else min(steps, task.fl.max_local_steps)
    fl = replace(
        task.fl,
        rounds=min(rounds, task.fl.rounds),
        max_local_steps=cap,
        clients_per_round=min(clients, task.fl.clients_per_round),
    )
    return replace(task, fl=fl)


def choose_task(applies: Callable[[Any], str | None], scenario: str | None) -> tuple[Task | None, str]:
    """The first smoke task ``applies`` accepts (in ``scenario`` if given), or None and the reasons."""
    reasons = []
    for name in [scenario] if scenario else scenario_order():
        try:
            tasks = smoke_tasks(name)
        except Exception as e:  # noqa: BLE001 - one unbuildable scenario must not hide the others
            if scenario:
                raise
            reasons.append(f"{name}: smoke preset does not build ({type(e).__name__}: {e})")
            continue
        for task in tasks:
            why = applies(task.api)
            if why is None:
                return task, ""
            reasons.append(f"{task.id}: {why}")
    return None, "; ".join(reasons) or "no scenario is registered"


# ----------------------------------------------------------------------------------------------
# static checks (no training)


def field_checks(report: Report, cls: type, kind: str) -> None:
    if not dataclasses.is_dataclass(cls):
        report.add(
            "hyper-parameters", False, f"{cls.__name__} is not a @dataclass: its fields are its hyper-parameters"
        )
        return
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    untyped = [f.name for f in fields if f.name not in hints]
    unsettable = []
    for f in fields:
        if f.default is dataclasses.MISSING or f.name not in hints:
            continue
        try:
            parse_value(str(f.default), hints[f.name], f.name)
        except UsageError:
            unsettable.append(f.name)
    desc = ", ".join(f"{f.name}: {getattr(hints.get(f.name), '__name__', hints.get(f.name))}" for f in fields) or "none"
    report.add("hyper-parameters", not untyped, f"fields {desc}" + (f"; untyped: {untyped}" if untyped else ""))
    if unsettable:
        report.add("command line", False, f"not settable as name:param=value: {', '.join(unsettable)}", warn_only=True)
    numeric = [describe_field(f, hints[f.name]) for f in fields if f.name in hints and range_of(f, hints[f.name])]
    try:
        build(cls, {}, kind)  # the defaults, range-checked like any configuration
        report.add("ranges", True, "; ".join(numeric) or "no numeric hyper-parameters")
    except Exception as e:  # noqa: BLE001 - report every kind of failure
        report.add("ranges", False, f"the default configuration is invalid: {e}")
    bad = []
    grid: Sequence[Mapping[str, Any]] = getattr(cls, "grid", ({},))
    for cfg in grid:
        try:
            build(cls, dict(cfg), kind)
        except Exception as e:  # noqa: BLE001 - report every kind of failure
            bad.append(f"{dict(cfg)}: {e}")
    report.add("grid", not bad, f"{len(grid)} configuration(s)" + (f"; invalid: {'; '.join(bad)}" if bad else ""))
    task_fields = {f.name for f in dataclasses.fields(TaskAPI)}
    requires = getattr(cls, "requires", ())
    unknown = [r for r in requires if r not in task_fields] if isinstance(requires, tuple) else [requires]
    report.add(
        "requires",
        not unknown,
        f"{requires or 'no optional task fields'}" + (f"; not TaskAPI fields: {unknown}" if unknown else ""),
    )
    if kind == "attack":
        budget = getattr(cls, "budget", {})
        names = {f.name for f in fields}
        bad_caps = (
            [
                f"{k}={v!r}"
                for k, v in dict(budget).items()
                if k not in names or not isinstance(v, int) or isinstance(v, bool) or v < 1
            ]
            if isinstance(budget, Mapping)
            else [repr(budget)]
        )
        report.add(
            "budget",
            not bad_caps,
            (f"{budget!r}" if budget else "none declared")
            + (f"; not a field with an int cap >= 1: {', '.join(bad_caps)}" if bad_caps else ""),
        )
