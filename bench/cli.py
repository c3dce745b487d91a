"""Command line: ``python -m bench run | list | leaderboard | check``.

Every argument is validated before anything is written: bad input prints the problem and the
valid choices and exits with code 2.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from .assets import AssetMissing
from .cli_args import (
    build_parser,
    idle_executor,
    make_executor,
    only_tasks,
    parse_seeds,
    positive_number,
    redo_time,
    scenario_names,
    task_ids,
    view_names,
    worker_config,
)
from .device import check_precision, resolve_device, with_precision
from .params import writable_dir
from .progress import silence_third_party
from .registry import ATTACKS, DEFENSES, SCENARIOS, UsageError, expand
from .store import Store
from .task import check_preset


def scenario_tasks(name: str, preset: str, precision: str = "fp32"):
    """The tasks of one scenario at a preset (and --precision); picklable by reference, so a worker process
    can rebuild them."""
    return [with_precision(t, precision) for t in SCENARIOS.get(name)(preset)]


def build_tasks(names: list[str], preset: str, precision: str = "fp32"):
    tasks = []
    for n in names:
        for t in scenario_tasks(n, preset, precision):
            if t.source is None:
                t.source = (
                    functools.partial(scenario_tasks, n, preset, precision)
                    if precision != "fp32"
                    else functools.partial(scenario_tasks, n, preset)
                )
            tasks.append(t)
    return tasks


def cmd_run(a) -> int:
    preset = check_preset(a.preset)
    seeds = parse_seeds(a.seeds)
    views = view_names(a.view)
    redo = redo_time(a.redo_before)
    names = scenario_names(a.scenario)
    tids = task_ids(a.task, names, preset)
    out = writable_dir(a.out)  # before any work: a bad --out fails now, not after training
    full = (a.grid or ("defaults" if preset == "smoke" else "full")) == "full"
    defenses = expand(DEFENSES, a.defense, full_grid=full)
    attacks = expand(ATTACKS, a.attack)
    device = resolve_device(a.device)
    precision = check_precision(a.precision, device)
    jobs, cfg = worker_config(a, preset, device)  # after expand(): contributed files are loaded by then
    if not a.verbose:
        silence_third_party()
    from .costs import CostModel
    from .runner import plan, run
    from .runplan import by_phase, listing, make_plan

    # every cell recorded already: plan over the declarations (bench.specs), no task built, no model library
    # imported; otherwise build them (may raise AssetMissing: still nothing written)
    tasks = recorded_tasks(
        names, preset, precision, defenses, attacks, seeds, out, readonly=a.dry_run, redo=redo, views=views, task=tids
    )
    recorded = tasks is not None
    if tasks is None:
        tasks = only_tasks(build_tasks(names, preset, precision), tids)

    if a.dry_run:  # the plan only: nothing is written (a damaged record is reported, not moved), no worker started
        store, costs = Store(out, readonly=True), CostModel.from_records(out, readonly=True, device=device)
        pl = make_plan(plan(tasks, defenses, attacks, seeds, views=views), store, costs, jobs=jobs, redo_before=redo)
        print(pl.render())
        if a.verbose:  # the cells themselves, by training run
            print(listing(pl))
        return 0
    executor = idle_executor(jobs) if recorded else make_executor(a, jobs, cfg)
    summary = run(
        tasks,
        defenses,
        attacks,
        seeds,
        out,
        executor=executor,
        device=device,
        on_plan=lambda pl: print(pl.render()),
        redo_before=redo,
        views=views,
    )
    c = summary.counts
    div = f" ({summary.diverged} of them: training diverged under the defense)" if summary.diverged else ""
    print(
        f"cells: {c['ok']} ok, {c['n/a']} n/a, {c['failed']} failed{div}, {c['skipped']} already done "
        f"({summary.wall_s:.0f} s); records in {out / 'records'}"
    )
    if summary.by_phase:  # where the time went (worker seconds; with --jobs N they overlap)
        print(f"worker time by phase: {by_phase(summary.by_phase)}")
    for line in summary.failed:  # each failure named with its reason (also in the leaderboards' Failed section)
        print(f"failed: {line}", file=sys.stderr)
    if not a.no_leaderboard:
        from .report.lbcache import print_notices, regenerate, up_to_date

        notices = up_to_date(out)  # nothing they read changed: not rewritten (`bench leaderboard` always does)
        if notices is not None:
            print_notices(notices)
            print(f"leaderboards up to date: {out / 'leaderboards'}")
        else:
            for path in regenerate(out):
                print(f"wrote {path}")
    warn_positive_controls(out)
    return 0


def recorded_tasks(
    names: list[str],
    preset: str,
    precision: str,
    defenses,
    attacks,
    seeds,
    out: Path,
    *,
    readonly: bool = False,
    redo=None,
    views=None,
    task: tuple[str, ...] | None = None,
) -> list | None:
    """The scenarios' declared tasks (bench.specs) when every cell they plan is finished (ok or n/a) in ``out``,
    so a fully cached re-run builds none; None when a cell is to run, a scenario declares no configuration at
    this preset, or declaring fails (building then runs, or reports the problem). ``readonly``: damaged records
    are skipped, not quarantined (a dry run); ``redo``: --redo-before's time; ``views``: --view's views; ``task``:
    --task's ids."""
    from .runner import plan
    from .runplan import Done
    from .specs import configured, declared

    if not (Path(out) / "records").is_dir():
        return None
    store = Store(out, readonly=readonly)
    done = Done(store, redo_before=redo)
    tasks: list = []
    try:
        for n in names:  # scenario by scenario: the first unfinished cell ends the check
            decl = declared(SCENARIOS.get(n), preset)
            if not configured(decl):
                return None
            mine = [with_precision(d, precision) for d in decl or () if task is None or d.id in task]
            cells = plan(mine, defenses, attacks, seeds, views=views)
            if not all(c.error is None and done(c) for c in cells):
                return None
            tasks.extend(mine)
    except Exception:  # noqa: BLE001 - only a shortcut: building the tasks gives the authoritative error
        return None
    return tasks


def warn_positive_controls(out: Path) -> None:
    """Warn (stderr) when a task's undefended baseline fails its positive control (bench/controls.py)."""
    from .controls import failures
    from .store import current_config

    for line in failures(current_config(list(Store(out).records()))[0]):
        print(
            f"warning: positive control failed: {line}; 'this defense stops the attack' is inconclusive there",
            file=sys.stderr,
        )


def listed_tasks(names: list[str], preset: str) -> list:
    """What ``bench list`` plans over: each scenario's static declarations (bench.specs: no data, no model),
    its built tasks only where it declares none at this preset."""
    from .specs import declared

    out: list = []
    for n in names:
        d = declared(SCENARIOS.get(n), preset)
        out.extend(d if d is not None else build_tasks([n], preset))
    return out


def cmd_list(a) -> int:
    from .runner import plan

    preset = check_preset(a.preset)
    names = scenario_names(a.scenario)
    print("scenarios:", ", ".join(SCENARIOS.names()))
    print("defenses:")
    for name, cls in DEFENSES.items():
        print(f"  {name:16s} {cls.setting:9s} configs={len(cls.grid)}  {cls.paper}")
    print("attacks:")
    for name, acls in ATTACKS.items():
        print(f"  {name:20s} {acls.kind:14s} views={','.join(acls.views)}  {acls.paper}")
    tasks = listed_tasks(names, preset)
    cells = plan(tasks, expand(DEFENSES, "all", full_grid=preset != "smoke"), expand(ATTACKS, "all"), [0])
    print(
        f"cells at preset {preset} (one seed): {sum(c.na is None for c in cells)} apply, "
        f"{sum(c.na is not None for c in cells)} n/a"
    )
    for c in cells:
        status = f"failed: {c.error}" if getattr(c, "error", None) else "applies" if c.na is None else f"n/a: {c.na}"
        print(f"  {c.task.id:22s} {c.defense_label:34s} {c.attack.name:20s} {c.view:15s} {status}")
    return 0


def cmd_leaderboard(a) -> int:
    from .report.lbcache import regenerate

    out = writable_dir(a.out)  # the leaderboards are written under it
    if a.restore is not None:
        from .report.snapshot import restore

        snap = Path(a.restore)
        if not snap.is_dir():
            raise UsageError(
                f"--restore {a.restore!r} is not a directory (a published snapshot, e.g. leaderboards/default)"
            )
        print(f"restored {restore(snap, out)} records from {snap} into {out / 'records'}")
    if not (out / "records").is_dir():
        raise UsageError(f"no records under {out / 'records'}; run `python -m bench run --out {out}` first")
    if a.publish is not None:
        from .report.snapshot import publish

        snap = writable_dir(a.publish, flag="--publish")
        s, o = snap.resolve(), out.resolve()
        if s == o or o in s.parents or s in o.parents:
            raise UsageError(
                f"--publish {a.publish!r} and --out {a.out!r} must not contain each other "
                "(the snapshot is replaced whole)"
            )
        files = publish(out, snap)
        print(f"published {len(files)} files to {snap}")
        return 0
    for path in regenerate(out):  # always rewritten, whatever the manifest says
        print(f"wrote {path}")
    return 0


def cmd_check(a) -> int:
    from .conformance import CHECK_TIMEOUT_S, check_attack, check_defense

    if (a.defense is None) == (a.attack is None):
        raise UsageError(
            "check takes exactly one of --defense NAME|PATH or --attack NAME|PATH"
            + (", not both" if a.defense is not None else "")
        )
    timeout = positive_number(a.timeout, "--timeout")
    timeout = CHECK_TIMEOUT_S if timeout is None else timeout
    if a.defense is not None:
        return check_defense(a.defense, a.scenario or None, timeout_s=timeout)
    return check_attack(a.attack, a.scenario or None, timeout_s=timeout)


def main(argv: list[str] | None = None) -> int:
    try:
        threads = os.environ.get("BENCH_THREADS", "").strip()
        if threads:  # e.g. 1 on a shared machine: torch's intra-op threads then never wait on each other
            import torch

            torch.set_num_threads(int(positive_number(threads, "BENCH_THREADS", integer=True)))
        a = build_parser().parse_args(argv)
        return {"run": cmd_run, "list": cmd_list, "leaderboard": cmd_leaderboard, "check": cmd_check}[a.cmd](a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AssetMissing as e:
        print(f"error: missing offline asset: {e}", file=sys.stderr)
        return 2
