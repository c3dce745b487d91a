"""`bench check` runs each configuration in a child with a wall-clock budget (issue 13): a contributed
defense that hangs, or exits with SystemExit in client_step / aggregate, is reported FAIL and check exits
1, and the configurations after it are still checked; so are one that reports a NaN or negative epsilon and
one that asks for more memory than the child's cap; `check --attack` is wired; bad flag combinations
exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "image-cls"  # the cheapest smoke scenario

# 90% of RAM as address space: above the check child's cap (75% of RAM), so only the cap refuses it (the
# pages are never touched, so without a cap the allocation would succeed and the check would pass)
HOG = "torch.empty(int(0.9 * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')), dtype=torch.uint8)"

MISBEHAVING = {  # file stem -> (line in client_step, line in aggregate, epsilon it reports)
    "hangs": ("time.sleep(10**6)", "", "None"),
    "exits_in_client": ("sys.exit(0)", "", "None"),
    "exits_in_aggregate": ("", "sys.exit(0)", "None"),
    "nan_epsilon": ("", "", "float('nan')"),
    "negative_epsilon": ("", "", "-1.0"),
    "hungry": (f"self.hog = {HOG}", "", "None"),
}


def defense_source(client_line: str, aggregate_line: str, epsilon: str = "None") -> str:
    return (
        "import os\nimport sys\nimport time\nfrom dataclasses import dataclass\n\nimport torch\n\n"
        "from bench.fl import fedavg_aggregate, standard_message\n"
        "from bench.registry import register_defense\n"
        "from bench.types import Defense\n\n\n"
        "@register_defense\n@dataclass\nclass Misbehaving(Defense):\n"
        "    def client_step(self, state, ctx):\n"
        f"        {client_line or 'pass'}\n"
        "        return standard_message(state, ctx)\n\n"
        "    def aggregate(self, global_state, msgs, ctx):\n"
        f"        {aggregate_line or 'pass'}\n"
        "        return fedavg_aggregate(global_state, msgs, ctx)\n\n"
        "    def epsilon(self, *, delta):\n"
        f"        return {epsilon}\n"
    )


def bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BENCH_QUIET": "1", "BENCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )  # far above what the --timeout below allows: the test itself cannot hang


def blocks(stdout: str) -> dict[str, str]:
    """Each report's text keyed by its subject's first word after 'defense' / 'attack'."""
    out: dict[str, str] = {}
    for block in stdout.split("bench check: ")[1:]:
        out[block.split()[1].split("(")[0]] = block
    return out


def test_check_fails_hanging_and_exiting_defenses_and_goes_on(tmp_path):
    paths = []
    for stem, (client, agg, eps) in MISBEHAVING.items():
        (tmp_path / f"{stem}.py").write_text(defense_source(client, agg, eps))
        paths.append(str(tmp_path / f"{stem}.py"))

    res = bench(
        "check", "--defense", ",".join([*paths, "fedavg"]), "--scenario", SCENARIO, "--timeout", "20", cwd=tmp_path
    )

    assert res.returncode == 1, res.stdout + res.stderr
    rep = blocks(res.stdout)
    assert set(rep) == {*MISBEHAVING, "fedavg"}, res.stdout
    assert "FAIL  run                timed out after 20 s" in rep["hangs"], rep["hangs"]
    assert "FAIL  train              SystemExit: 0" in rep["exits_in_client"], rep["exits_in_client"]
    assert "FAIL  train              SystemExit: 0" in rep["exits_in_aggregate"], rep["exits_in_aggregate"]
    assert "FAIL  epsilon            delta=" in rep["nan_epsilon"] and "epsilon=nan (must be" in rep["nan_epsilon"]
    assert "epsilon=-1.0 (must be None or >= 0" in rep["negative_epsilon"], rep["negative_epsilon"]
    assert "FAIL  train" in rep["hungry"] and "can't allocate memory" in rep["hungry"], rep["hungry"]
    assert "result: all checks passed" in rep["fedavg"], rep["fedavg"]  # the killed worker was replaced
    assert "Traceback" not in res.stderr


def test_check_attack_runs_a_registered_attack(tmp_path):
    res = bench("check", "--attack", "loss_mia", "--scenario", SCENARIO, cwd=tmp_path)

    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("bench check: attack loss_mia on image-cls")
    assert "PASS  output" in res.stdout and "FAIL" not in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["check", "--defense", "fedavg", "--attack", "loss_mia"], "exactly one of --defense"),
        (["check", "--scenario", SCENARIO], "exactly one of --defense"),
        (["check", "--defense", "fedavg", "--timeout", "-3"], "--timeout must be > 0"),
        (["check", "--defense", "fedavg", "--timeout", "soon"], "--timeout must be a number"),
        (["check", "--attack", "nope"], "nope"),
    ],
)
def test_check_bad_flags_exit_2_and_write_nothing(args, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    code = main(args)

    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and needle in err, err
    assert not list(tmp_path.iterdir())
