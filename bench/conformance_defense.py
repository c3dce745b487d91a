"""Conformance checks of a defense (``python -m bench check --defense``; the module doc of
:mod:`bench.conformance` lists them): a few smoke rounds, twice with one seed (the second stopped at its first
checkpoint and resumed), each message, aggregate and epsilon checked against the contract, a time budget and a
utility floor. :mod:`bench.conformance` runs each configuration's report in an isolated child."""

from __future__ import annotations

import copy
import math
import os
import random
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Subset

from .checkpoint import Checkpoint
from .conformance_common import CLIENTS_PER_ROUND, MAX_LOCAL_STEPS, ROUNDS, Report, choose_task, field_checks, shrink
from .params import valid_epsilon
from .registry import UsageError
from .run_state import resolve_delta
from .task import Task
from .types import Defense, Message, n_items


def _budget_from_env() -> float:
    """``BENCH_CHECK_BUDGET_S`` (default 600): a value that is not a positive number is a usage error (exit 2)."""
    raw = os.environ.get("BENCH_CHECK_BUDGET_S", "").strip() or "600"
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise UsageError(f"BENCH_CHECK_BUDGET_S must be a positive number of seconds, got {raw!r}")
    return v


TIME_BUDGET_S = _budget_from_env()  # per training run, smoke preset


class _Probe:
    """Wraps a defense for run_federated and records the first violation of each contract."""

    def __init__(self, inner: Defense):
        self.inner = inner
        self.violations: dict[str, str] = {}
        self.messages = 0

    def __getattr__(self, k: str) -> Any:
        return getattr(self.inner, k)

    def flag(self, check: str, msg: str) -> None:
        self.violations.setdefault(check, msg)

    def client_step(self, state, ctx) -> Message:
        before = {n: t.clone() for n, t in ctx.global_state.items()}
        msg = self.inner.client_step(state, ctx)
        self.messages += 1
        where = f"client {state.client} round {ctx.round}"
        if not isinstance(msg, Message):
            self.flag("message", f"{where}: client_step returned {type(msg).__name__}, not a Message")
            return msg
        if msg.kind not in ("weights", "gradient"):
            self.flag("message", f"{where}: kind {msg.kind!r} is not 'weights' or 'gradient'")
        if not isinstance(msg.num_samples, int) or msg.num_samples < 1:
            self.flag("message", f"{where}: num_samples {msg.num_samples!r} must be a positive int")
        if msg.client != state.client or msg.round != ctx.round:
            self.flag("message", f"{where}: message says client {msg.client} round {msg.round}")
        for n, t in msg.tensors.items():
            if n not in ctx.global_state:
                self.flag("shapes", f"{where}: unknown parameter {n!r} (not among the shared names)")
            elif tuple(t.shape) != tuple(ctx.global_state[n].shape):
                self.flag(
                    "shapes",
                    f"{where}: {n!r} has shape {tuple(t.shape)}, the global state {tuple(ctx.global_state[n].shape)}",
                )
            if not torch.is_floating_point(t):
                self.flag("message", f"{where}: {n!r} has dtype {t.dtype}, expected floating point")
            elif not torch.isfinite(t).all():
                self.flag("finite", f"{where}: {n!r} contains NaN or inf")
            if t.requires_grad:
                self.flag("detached", f"{where}: {n!r} requires grad (send t.detach().clone())")
        changed = [n for n, t in before.items() if not torch.equal(t, ctx.global_state[n])]
        if changed:
            self.flag("isolation", f"{where}: client_step changed the global state in place ({changed[0]!r})")
        return msg

    def aggregate(self, global_state, msgs, ctx):
        new = self.inner.aggregate(global_state, msgs, ctx)
        where = f"round {ctx.round}"
        if not isinstance(new, dict) or set(new) != set(global_state):
            missing = sorted(set(global_state) - set(new or {}))[:3]
            extra = sorted(set(new or {}) - set(global_state))[:3]
            self.flag("aggregate", f"{where}: keys differ from the global state (missing {missing}, extra {extra})")
            return new
        for n, t in new.items():
            if tuple(t.shape) != tuple(global_state[n].shape):
                self.flag(
                    "shapes",
                    f"{where}: aggregate gives {n!r} shape {tuple(t.shape)}, expected {tuple(global_state[n].shape)}",
                )
            elif not torch.isfinite(t).all():
                self.flag("finite", f"{where}: aggregate gives non-finite values in {n!r}")
        return new


def _train(task: Task, probe: _Probe, seed: int, py_seed: int):
    """One training run of the probed defense; Python / NumPy global seeds differ between runs on purpose."""
    from .fl import run_federated

    random.seed(py_seed)
    np.random.seed(py_seed)  # noqa: NPY002 -- the legacy global state is what a careless defense would draw from
    t0 = time.time()
    model, res = run_federated(task, cast(Defense, probe), seed, desc="check")  # a duck-typed Defense proxy
    return model, res, time.time() - t0


class _Stop(Exception):
    """Ends a conformance run right after its first checkpoint (a kill, without the process dying)."""


class _StopAfterSave(Checkpoint):
    def save(self, state: dict[str, Any]) -> None:
        super().save(state)
        if self.unsaved:
            raise TypeError(self.unsaved)
        raise _Stop


def _train_resumed(task: Task, defense: Defense, seed: int, py_seed: int):
    """A run stopped at its first checkpoint (after round 1; a central run: after epoch 1) and resumed from it
    (bench.checkpoint), which must give the uninterrupted run's result."""
    from .fl import run_federated

    random.seed(py_seed)
    np.random.seed(py_seed)  # noqa: NPY002
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        path, stopped = Path(tmp) / "run.ckpt", False
        try:
            _, res = run_federated(task, defense, seed, desc="check", checkpoint=_StopAfterSave(path, "check", 0.0))
        except _Stop:
            stopped = True
            random.seed(py_seed + 1)  # the resumed process's own global seeds: the checkpoint must restore them
            np.random.seed(py_seed + 1)  # noqa: NPY002
            _, res = run_federated(task, defense, seed, desc="check", checkpoint=Checkpoint(path, "check", math.inf))
    return res, time.time() - t0, stopped


HELDOUT = 32  # test items for the utility floor


@torch.no_grad()
def heldout_loss(task: Task, model, n: int = HELDOUT) -> float:
    """The task's own loss on the first ``n`` test items, with a fixed seed (diffusion losses draw noise)."""
    data = task.test_data
    items = [data[i] for i in range(min(n, n_items(data)))]
    if not items:
        raise ValueError(f"{task.id} has no test data")
    model.eval()
    torch.manual_seed(0)
    bs = max(1, task.fl.batch_size)
    total = 0.0
    for i in range(0, len(items), bs):
        chunk = items[i : i + bs]
        total += float(task.api.loss(model, task.api.collate(chunk))) * len(chunk)
    return total / len(items)


_UNTRAINED: dict[tuple, float] = {}


def untrained_loss(task: Task, defense: Defense, model0) -> float:
    """Held-out loss before training (cached per task for defenses that keep Defense.setup)."""
    key = (task.id, task.preset, task.config_hash())
    if type(defense).setup is not Defense.setup:
        return heldout_loss(task, model0)
    if key not in _UNTRAINED:
        _UNTRAINED[key] = heldout_loss(task, model0)
    return _UNTRAINED[key]


def utility_floor(trained: float, untrained: float) -> tuple[bool, str]:
    """Held-out loss after training must not exceed the untrained model's by more than max(0.05, 10%)."""
    margin = max(0.05, 0.1 * abs(untrained))
    ok = math.isfinite(trained) and trained <= untrained + margin
    return ok, f"held-out loss {trained:.4g} after training vs {untrained:.4g} untrained (margin {margin:.3g})"


def _contract_checks(report: Report, probe: _Probe) -> None:
    for name in ("message", "shapes", "finite", "aggregate", "isolation", "detached"):
        msg = probe.violations.get(name)
        if msg is None and not probe.messages:
            report.add(name, None, "no message was sent")
        else:
            report.add(name, msg is None, msg or "ok", warn_only=name == "detached")


def check_defense_config(
    defense: Defense, task: Task, report: Report, *, seed: int = 0, budget_s: float = TIME_BUDGET_S
) -> None:
    """Train twice on ``task`` (already shrunk) and record every check in ``report``."""
    from .matrix import views_of
    from .training import build_trained_model

    setting_ok = defense.setting in ("federated", "central")
    report.add(
        "setting / views",
        setting_ok,
        f"setting {defense.setting!r} exposes {'/'.join(views_of(defense)) if setting_ok else 'nothing'}",
    )
    mode = defense.fl_mode()
    report.add("fl mode", mode in (None, "fedavg", "fedsgd"), f"fl_mode() = {mode!r}")
    if defense.setting == "central" and task.central_data is None:
        report.add("train", None, f"{task.id} has no central data for a central defense")
        return
    probe = _Probe(copy.deepcopy(defense))
    try:
        model, res, wall = _train(task, probe, seed, 1)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit from a defense included: check must fail it
        tb = traceback.extract_tb(e.__traceback__)[-1]
        report.add("train", False, f"{type(e).__name__}: {e} (at {os.path.basename(tb.filename)}:{tb.lineno})")
        _contract_checks(report, probe)
        return
    report.add("train", True, f"{len(res.bytes_down)} rounds, {probe.messages} messages, {wall:.1f} s")
    _contract_checks(report, probe)
    fresh = copy.deepcopy(defense)
    model0 = fresh.setup(task.api.build_model(), task.api)
    names = [n for n in res.global_state]
    p0 = dict(model0.named_parameters())
    moved = [n for n in names if n in p0 and not torch.equal(p0[n].detach(), res.global_state[n])]
    report.add("updates", bool(moved), f"{len(moved)}/{len(names)} shared tensors changed by training")
    try:
        res2, wall2, stopped = _train_resumed(task, cast(Defense, _Probe(copy.deepcopy(defense))), seed, 2)
        diff = [n for n in res.global_state if not torch.equal(res.global_state[n], res2.global_state[n])]
        same_t = res.transcript == res2.transcript
        how = (
            "second run stopped at its first checkpoint (after round 1, or a central run's epoch 1) and resumed"
            if stopped
            else "second run saved no checkpoint (one round, no epoch checkpoints in its loop): not resumed"
        )
        detail = (
            f"identical global state and transcript for seed 0 ({how})"
            if not diff and same_t
            else (
                f"{len(diff)} tensor(s) differ between two runs with seed {seed}"
                + (
                    f" (first {diff[0]!r}, max |diff| "
                    f"{float((res.global_state[diff[0]] - res2.global_state[diff[0]]).abs().max()):.3g})"
                    if diff
                    else ""
                )
                + ("" if same_t else "; the message transcripts differ")
                + f" ({how}; hint: draw "
                "randomness from ctx.generator, not the random / numpy global state, and keep state across "
                "rounds in ClientState.private or DefenseRun.state, which checkpoints save)"
            )
        )
        report.add("determinism", not diff and same_t, detail)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        hint = " (round checkpoints save ClientState.private and DefenseRun.state: bench/checkpoint.py)"
        report.add("determinism", False, f"second (resumed) run raised {type(e).__name__}: {e}" + hint)
        wall2 = 0.0
    report.add(
        "time budget", max(wall, wall2) <= budget_s, f"{max(wall, wall2):.1f} s per run (budget {budget_s:.0f} s)"
    )
    delta = resolve_delta(defense, task.api)  # the run's delta, as the harness records it
    eps_detail, eps_ok = [], True
    trained = probe.inner
    try:
        eps = trained.epsilon(delta=delta)
        rate = 1.0 if defense.setting == "central" else task.fl.clients_per_round / task.fl.num_clients
        comp = trained.epsilon_composed(
            delta=delta, rounds=len(res.bytes_down), sample_rate=rate, names=tuple(res.global_state)
        )
        for label, v in (("epsilon", eps), ("epsilon_composed", comp)):
            good = valid_epsilon(v)
            eps_ok &= good
            eps_detail.append(f"{label}={v!r}" + ("" if good else " (must be None or >= 0, finite)"))
        if eps is None and comp is not None:
            eps_detail.append("composed epsilon without a per-release epsilon")
    except Exception as e:  # noqa: BLE001
        eps_ok, eps = False, None
        eps_detail.append(f"raised {type(e).__name__}: {e}")
    report.add("epsilon", eps_ok, f"delta={delta:g}: " + ", ".join(eps_detail))
    try:
        after = heldout_loss(task, build_trained_model(task, trained, res.global_state))
        ok, detail = utility_floor(after, untrained_loss(task, defense, model0))
        report.add(
            "utility floor",
            ok,
            detail + ("; DP noise may cost this much" if ok is False and eps is not None else ""),
            warn_only=eps is not None,
        )
    except Exception as e:  # noqa: BLE001
        report.add("utility floor", False, f"utility evaluation raised {type(e).__name__}: {e}")


def defense_report(
    defense: Defense, scenario: str | None, *, rounds: int = ROUNDS, budget_s: float = TIME_BUDGET_S
) -> Report:
    from .training import label

    report = Report(f"defense {label(defense)}")
    field_checks(report, type(defense), "defense")
    report.add("base class", isinstance(defense, Defense), type(defense).__mro__[1].__name__)
    try:
        task, why = choose_task(defense.applies, scenario)
    except Exception as e:  # noqa: BLE001
        report.add("applies", False, f"applies() raised {type(e).__name__}: {e}")
        return report
    if task is None:
        report.add("applies", False, f"applies to no smoke task ({why})")
        return report
    report.subject += (
        f" on {task.id} (smoke, {rounds} rounds of {CLIENTS_PER_ROUND} clients, <= {MAX_LOCAL_STEPS} local steps)"
    )
    report.add("applies", True, f"{task.id}")
    task = shrink(task, rounds)
    if defense.setting == "central" and task.central_data is not None:
        task = two_epochs(task)
    check_defense_config(defense, task, report, budget_s=budget_s)
    return report


def two_epochs(task: Task) -> Task:
    """A central run of 2 epochs of at most 2 batches: one round that crosses an epoch checkpoint."""
    assert task.central_data is not None
    n = min(n_items(task.central_data), 2 * task.fl.batch_size)
    fl = replace(task.fl, max_local_steps=None)
    return replace(task, central_data=Subset(task.central_data, range(n)), central_epochs=2, fl=fl)
