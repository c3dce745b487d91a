"""Conformance checks of an attack (``python -m bench check --attack``, tests/test_conformance.py): its declared
kind and views, its ``resolved()`` values, and one run on a smoke observation of an untrained (base) model (scores:
one finite value per candidate; reconstructions: finite, in the model's input shape), its budget capped."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import replace

import torch

from .conformance_common import Report, choose_task, field_checks
from .registry import DEFENSES, build
from .task import Task
from .types import VIEWS, Attack, Reconstructions, Scores


def attack_report(attack: Attack, scenario: str | None = None, *, seed: int = 0) -> Report:
    """Declared kind / views, then one run on a smoke observation of an untrained (base) model."""
    from .training import label

    report = Report(f"attack {label(attack)}")
    field_checks(report, type(attack), "attack")
    kind_ok = attack.kind in ("membership", "reconstruction")
    report.add("kind", kind_ok, repr(attack.kind))
    views = tuple(attack.views)
    report.add("views", bool(views) and set(views) <= set(VIEWS), f"{views} (valid: {', '.join(VIEWS)})")
    if attack.kind == "reconstruction":
        report.add("views", "client_update" in views, "a reconstruction attack observes client_update")
    if not kind_ok:
        return report
    task, why = choose_task(attack.applies, scenario)
    if task is None:
        report.add("applies", None, f"applies to no registered smoke task ({why})")
        return report
    report.add("applies", True, task.id)
    _check_resolved(report, attack, task)
    attack, capped = cap_budget(attack)
    report.subject += f" on {task.id} (smoke{'; capped ' + ', '.join(capped) if capped else ''})"
    t0 = time.time()
    try:
        torch.manual_seed(seed)
        detail = _run_membership(attack, task, seed) if attack.kind == "membership" else _run_recon(attack, task, seed)
        report.add("output", True, f"{detail} ({time.time() - t0:.1f} s)")
    except _Bad as e:
        report.add("output", False, str(e))
    except Exception as e:  # noqa: BLE001
        report.add("run", False, f"{type(e).__name__}: {e}")
    return report


class _Bad(Exception):
    pass


def _check_resolved(report: Report, attack: Attack, task: Task) -> None:
    """``resolved(task)`` (bench.matrix.Cell.expected keeps it in the record): plain values, keyed by fields the
    configuration leaves at None."""
    try:
        res = attack.resolved(task.api) if hasattr(attack, "resolved") else {}
    except Exception as e:  # noqa: BLE001
        report.add("resolved", False, f"resolved() raised {type(e).__name__}: {e}")
        return
    names: list[str] = [f.name for f in dataclasses.fields(attack)] if dataclasses.is_dataclass(attack) else []
    unset = {n for n in names if getattr(attack, n) is None}
    bad = (
        [f"{k}={v!r}" for k, v in res.items() if k not in unset or not isinstance(v, (int, float, str, bool))]
        if isinstance(res, dict)
        else [repr(res)]
    )
    report.add(
        "resolved",
        not bad,
        f"{res or 'nothing left to the task'}" + (f"; not a None field with a plain value: {bad}" if bad else ""),
    )


def cap_budget(attack: Attack) -> tuple[Attack, list[str]]:
    """The attack with the compute-budget fields it declares (``Attack.budget``: output types are checked,
    not strength) capped; ``None`` means "the scenario's", which can be the paper's 24,000 iterations, so
    it is capped too."""
    if not dataclasses.is_dataclass(attack):
        return attack, []
    budget = dict(getattr(type(attack), "budget", {}) or {})
    changes, notes = {}, []
    for f in dataclasses.fields(attack):
        cap = budget.get(f.name)
        v = getattr(attack, f.name)
        if f.init and cap is not None and (v is None or (isinstance(v, int) and not isinstance(v, bool) and v > cap)):
            changes[f.name] = cap
            notes.append(f"{f.name} {v}->{cap}")
    return (replace(attack, **changes) if changes else attack), notes


def _run_membership(attack: Attack, task: Task, seed: int) -> str:
    """One run on the base model's candidates, observed as the harness observes them (bench.cells)."""
    from .cells import membership_observation, membership_parts

    pool, _, parts = membership_parts(task, None, "global_model", None, seed)
    part = parts[0]
    nonmembers = task.nonmembers
    assert nonmembers is not None  # membership_parts checked
    cands = [pool[i] for i in part.members] + [nonmembers[i] for i in part.nonmembers]
    obs = membership_observation(task, None, attack, "global_model", part, pool, seed)
    out = attack.run(obs, cands)
    if not isinstance(out, Scores):
        raise _Bad(f"returned {type(out).__name__}, expected Scores")
    if out.primary not in out.scores:
        raise _Bad(f"primary score {out.primary!r} is not among {sorted(out.scores)}")
    for name, s in out.scores.items():
        s = torch.as_tensor(s).detach().float()
        if tuple(s.shape) != (len(cands),):
            raise _Bad(f"score {name!r} has shape {tuple(s.shape)}, expected ({len(cands)},)")
        if not torch.isfinite(s).all():
            raise _Bad(f"score {name!r} contains NaN or inf")
    return f"{len(out.scores)} score vector(s) over {len(cands)} candidates, primary {out.primary!r}"


def _run_recon(attack: Attack, task: Task, seed: int) -> str:
    from .recon_cells import probe_observations

    if not task.recon_targets:
        raise _Bad(f"{task.id} has no reconstruction targets")
    fedavg = build(DEFENSES.get("fedavg"), {}, "defense")
    obs, targets = probe_observations(replace(task, recon_targets=list(task.recon_targets)[:1]), fedavg, seed)
    outs = attack.run_batch(obs)
    if len(outs) != 1 or not isinstance(outs[0], Reconstructions):
        raise _Bad(f"returned {[type(o).__name__ for o in outs]}, expected one Reconstructions")
    img = outs[0].images
    want = tuple(targets[0][0].shape)
    if tuple(img.shape) != (1, *want):
        raise _Bad(f"images have shape {tuple(img.shape)}, expected (1, {', '.join(map(str, want))})")
    if not torch.isfinite(img).all():
        raise _Bad("reconstructed images contain NaN or inf")
    if outs[0].labels is not None and tuple(outs[0].labels.shape) != (1,):
        raise _Bad(f"labels have shape {tuple(outs[0].labels.shape)}, expected (1,)")
    return f"reconstruction of shape {tuple(img.shape)}"
