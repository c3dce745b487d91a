"""Command line: ``python -m bench run | list | leaderboard | check``.

Every argument is validated before anything is written: bad input prints the problem and the
valid choices and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .assets import AssetMissing
from .registry import ATTACKS, DEFENSES, SCENARIOS, UsageError, expand, unknown_message
from .task import PRESETS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors also exit 2, with our prefix
        self.print_usage(sys.stderr)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m bench", description="Privacy attacks x defenses benchmark for federated and LoRA fine-tuning")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run the defense x attack matrix and regenerate leaderboards")
    r.add_argument("--scenario", default="all", help="name, comma list or 'all'")
    r.add_argument("--defense", default="all", help="name[:param=value...], comma list, a .py path, or 'all'")
    r.add_argument("--attack", default="all", help="name[:param=value...], comma list, a .py path, or 'all'")
    r.add_argument("--preset", default="default", help=f"one of {', '.join(PRESETS)}")
    r.add_argument("--grid", default="", choices=["", "defaults", "full"],
                   help="a bare defense name runs its paper grid ('full') or its default configuration only "
                        "('defaults'); default: 'defaults' on the smoke preset, 'full' otherwise")
    r.add_argument("--seeds", default="1", help="number of seeds N (seeds 0..N-1)")
    r.add_argument("--out", default="results", help="output directory (records, cache, leaderboards)")
    r.add_argument("--no-leaderboard", action="store_true", help="do not regenerate leaderboards after the run")
    ls = sub.add_parser("list", help="list scenarios, defenses, attacks, and which cells apply")
    ls.add_argument("--preset", default="smoke", help="preset used to build the scenarios for the matrix")
    ls.add_argument("--scenario", default="all")
    lb = sub.add_parser("leaderboard", help="regenerate leaderboards from stored records")
    lb.add_argument("--out", default="results")
    ck = sub.add_parser("check", help="conformance checks for a defense on the smoke preset")
    ck.add_argument("--defense", required=True)
    ck.add_argument("--scenario", default="")
    return p


def scenario_names(arg: str) -> list[str]:
    names = SCENARIOS.names() if arg.strip() == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    for n in names:
        SCENARIOS.get(n)
    if not names:
        raise UsageError(unknown_message("scenario", arg, SCENARIOS.names()))
    return names


def check_preset(preset: str) -> str:
    if preset not in PRESETS:
        raise UsageError(unknown_message("preset", preset, list(PRESETS)))
    return preset


def parse_seeds(raw: str) -> list[int]:
    try:
        n = int(raw)
    except ValueError:
        raise UsageError(f"--seeds must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise UsageError(f"--seeds must be a positive integer, got {n}")
    return list(range(n))


def build_tasks(names: list[str], preset: str):
    return [t for n in names for t in SCENARIOS.get(n)(preset)]


def cmd_run(a) -> int:
    preset = check_preset(a.preset)
    names = scenario_names(a.scenario)
    full = (a.grid or ("defaults" if preset == "smoke" else "full")) == "full"
    defenses = expand(DEFENSES, a.defense, full_grid=full)
    attacks = expand(ATTACKS, a.attack)
    seeds = parse_seeds(a.seeds)
    tasks = build_tasks(names, preset)  # may raise AssetMissing: still nothing written
    from .runner import run

    out = Path(a.out)
    summary = run(tasks, defenses, attacks, seeds, out)
    c = summary.counts
    print(f"cells: {c['ok']} ok, {c['n/a']} n/a, {c['failed']} failed, {c['skipped']} already done "
          f"({summary.wall_s:.0f} s); records in {out / 'records'}")
    if not a.no_leaderboard:
        from .leaderboard import write_leaderboards

        for path in write_leaderboards(out):
            print(f"wrote {path}")
    return 0


def cmd_list(a) -> int:
    from .runner import plan

    preset = check_preset(a.preset)
    names = scenario_names(a.scenario)
    print("scenarios:", ", ".join(SCENARIOS.names()))
    print("defenses:")
    for name, cls in DEFENSES.items():
        print(f"  {name:16s} {cls.setting:9s} configs={len(cls.grid)}  {cls.paper}")
    print("attacks:")
    for name, cls in ATTACKS.items():
        print(f"  {name:20s} {cls.kind:14s} views={','.join(cls.views)}  {cls.paper}")
    tasks = build_tasks(names, preset)
    cells = plan(tasks, expand(DEFENSES, "all", full_grid=preset != "smoke"), expand(ATTACKS, "all"), [0])
    print(f"cells at preset {preset} (one seed): {sum(c.na is None for c in cells)} apply, "
          f"{sum(c.na is not None for c in cells)} n/a")
    for c in cells:
        status = "applies" if c.na is None else f"n/a: {c.na}"
        print(f"  {c.task.id:22s} {c.defense_label:34s} {c.attack.name:20s} {c.view:15s} {status}")
    return 0


def cmd_leaderboard(a) -> int:
    from .leaderboard import write_leaderboards

    out = Path(a.out)
    if not (out / "records").is_dir():
        raise UsageError(f"no records under {out / 'records'}; run `python -m bench run --out {out}` first")
    for path in write_leaderboards(out):
        print(f"wrote {path}")
    return 0


def cmd_check(a) -> int:
    from .conformance import check_defense

    return check_defense(a.defense, a.scenario or None)


def main(argv: list[str] | None = None) -> int:
    threads = os.environ.get("BENCH_THREADS", "").strip()
    if threads:  # e.g. 1 on a shared machine: torch's intra-op threads then never wait on each other
        import torch

        torch.set_num_threads(int(threads))
    try:
        a = build_parser().parse_args(argv)
        return {"run": cmd_run, "list": cmd_list, "leaderboard": cmd_leaderboard, "check": cmd_check}[a.cmd](a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AssetMissing as e:
        print(f"error: missing offline asset: {e}", file=sys.stderr)
        return 2
