"""Conformance checks for contributed defenses and attacks (``python -m bench check``, and pytest over every registered
one: tests/test_conformance.py).

A defense is trained for a few rounds on the ``smoke`` preset of a scenario it applies to, twice with the same seed
(and different Python / NumPy global seeds, so hidden unseeded randomness shows), and checked for: typed
hyper-parameters and a valid grid, a valid setting (threat views), messages whose tensors are a subset of the shared
parameters with the same shapes, finite values, no in-place change of the global state, an aggregate with the global
state's keys and shapes, identical global states for a fixed seed (the second run stopped at its first checkpoint and
resumed from it), epsilon None or >= 0, a time budget, and a utility floor (the task's held-out loss not
worse than the untrained model's by more than a margin; only a warning for defenses that declare an epsilon, whose
noise may legitimately cost that much). The held-out loss stands in for the scenario's utility (which can mean
sampling images for FID): cheap, and the same direction everywhere. An attack is checked for its declared kind and
views and run once on a smoke observation (scores: one finite value per candidate; reconstructions: finite, in the
model's input shape).

The shared pieces (the report, the smoke task a method is checked on, the static field checks) are in
:mod:`bench.conformance_common`, the attack's run in :mod:`bench.conformance_attack`, the defense's in
:mod:`bench.conformance_defense`; this module runs each configuration's checks in an isolated child (the command's
entry point).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from .conformance_attack import attack_report, cap_budget
from .conformance_common import (
    CLIENTS_PER_ROUND,
    MAX_LOCAL_STEPS,
    PREFERRED,
    ROUNDS,
    Check,
    Report,
    choose_task,
    field_checks,
    scenario_order,
    shrink,
    smoke_tasks,
)
from .conformance_defense import TIME_BUDGET_S, check_defense_config, defense_report, utility_floor
from .registry import ATTACKS, DEFENSES, SCENARIOS, UsageError, expand

__all__ = [  # the checks' names, wherever they live (tests and contributors import them from here)
    "CHECK_TIMEOUT_S",
    "CLIENTS_PER_ROUND",
    "MAX_LOCAL_STEPS",
    "PREFERRED",
    "ROUNDS",
    "TIME_BUDGET_S",
    "Check",
    "Report",
    "attack_report",
    "cap_budget",
    "check_attack",
    "check_defense",
    "check_defense_config",
    "choose_task",
    "defense_report",
    "field_checks",
    "scenario_order",
    "shrink",
    "smoke_tasks",
    "utility_floor",
]


# wall clock per configuration's child (two training runs plus evaluation); `check --timeout` overrides
CHECK_TIMEOUT_S = 3 * TIME_BUDGET_S


def _configs_or_report(registry, name_or_path: str, scenario: str | None, out: TextIO) -> list | None:
    """The configurations ``name_or_path`` expands to; None after printing a FAIL block when it does not import
    (bad user input, e.g. an unknown scenario or malformed spec, still raises UsageError: exit 2)."""
    if scenario:
        SCENARIOS.get(scenario)
    try:
        return expand(registry, name_or_path)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. the contributed file does not import: reported as a FAIL
        print(
            f"bench check: {name_or_path}\n  FAIL  import             {type(e).__name__}: {e}\n"
            "  result: 1 check(s) failed",
            file=out,
        )
        return None


def check_defense(
    name_or_path: str,
    scenario: str | None = None,
    *,
    out: TextIO | None = None,
    rounds: int = ROUNDS,
    budget_s: float = TIME_BUDGET_S,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> int:
    """``python -m bench check --defense``: every configuration the spec expands to, each in a child
    process with ``timeout_s`` of wall clock (see ``isolated_reports``); 0 if all pass, else 1."""
    out = out or sys.stdout
    configs = _configs_or_report(DEFENSES, name_or_path, scenario, out)
    if configs is None:
        return 1
    return isolated_reports(
        "defense", configs, scenario, out=out, timeout_s=timeout_s, rounds=rounds, budget_s=budget_s
    )


# ----------------------------------------------------------------------------------------------
# isolation: a configuration's report is built in a child process (bench.executors.Slot) with a
# wall-clock budget and a memory cap, so a contributed method that hangs, exits or eats the memory
# fails its check instead of hanging check or ending it with exit 0.


@dataclass
class _Job:
    key: str  # the report's subject, also the Slot outcome's key
    kind: str  # defense | attack
    subject: Any  # the configured Defense / Attack
    scenario: str | None
    options: dict = field(default_factory=dict)  # rounds / budget_s for defense_report
    name: str = ""  # the registry key: a class registered by an entry point in the parent is unnamed in the child


def _run_job(job: _Job) -> dict:
    """In the child: the configuration's report; anything that escapes it, SystemExit and
    KeyboardInterrupt included (a real Ctrl-C also reaches the parent), becomes a FAIL line."""
    try:
        if job.name and getattr(type(job.subject), "name", job.name) != job.name:
            type(job.subject).name = job.name  # what Registry.register did in the parent
        rep = (
            defense_report(job.subject, job.scenario, **job.options)
            if job.kind == "defense"
            else attack_report(job.subject, job.scenario)
        )
    except BaseException as e:  # noqa: BLE001
        rep = Report(job.key)
        rep.add("run", False, f"{type(e).__name__}: {e}")
    return {"key": job.key, "kind": job.kind, "status": "ok", "reason": "", "report": rep, "restart": False}


def isolated_reports(
    kind: str, subjects: list, scenario: str | None, *, out: TextIO, timeout_s: float, **options
) -> int:
    """Print each subject's report, built in one reused child (killed and replaced after a timeout or
    crash, which is then that subject's FAIL line); 1 if any check failed, else 0."""
    import concurrent.futures as cf

    from .executors import Slot, WorkerConfig, contributed_modules, default_mem_cap_mb, default_threads
    from .training import label

    cfg = WorkerConfig(
        threads=default_threads(1), mem_cap_mb=default_mem_cap_mb(1), timeout_s=timeout_s, contrib=contributed_modules()
    )
    slot = Slot(cfg)
    failed = 0
    # the slot waits in a thread, so Ctrl-C reaches this one (and kills the child) instead of becoming a FAIL
    with cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-check") as waiter:
        try:
            for s in subjects:
                job = _Job(
                    f"{kind} {label(s)}",
                    kind,
                    s,
                    scenario,
                    options if kind == "defense" else {},
                    name=getattr(type(s), "name", "") or "",
                )
                res = waiter.submit(slot.run, job, _run_job, flag="--timeout").result()
                rep = res.get("report")
                if rep is None:
                    rep = Report(job.key)
                    rep.add("run", False, res.get("reason") or "the check's worker failed")
                print(rep.render(), file=out, flush=True)
                failed += len(rep.failed)
        except KeyboardInterrupt:
            slot.close(kill=True)  # before the waiter is joined: it would wait for the unit
            raise
        finally:
            slot.close()
    return 1 if failed else 0


def check_attack(
    name_or_path: str, scenario: str | None = None, *, out: TextIO | None = None, timeout_s: float = CHECK_TIMEOUT_S
) -> int:
    """``python -m bench check --attack``: every configuration, each isolated like a defense's; 0 if all pass."""
    out = out or sys.stdout
    configs = _configs_or_report(ATTACKS, name_or_path, scenario, out)
    if configs is None:
        return 1
    return isolated_reports("attack", configs, scenario, out=out, timeout_s=timeout_s)
