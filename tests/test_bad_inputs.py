"""Bad input never crashes a run (issue 13, "Input handling"): every case exits 2 with a message that
names the problem, prints no traceback and writes nothing under --out (nor in the working folder).

The CLI runs in-process (``bench.cli.main``) so the table stays fast; one case goes through a real
subprocess. Contributed files are written to a temporary folder outside the repository.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from bench.cli import main
from bench.params import MAX_SEEDS, check_privacy, field_problem, param, range_of
from bench.registry import ATTACKS, DEFENSES, UsageError, build, expand

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------------
# the table: (extra arguments of `run --preset smoke`, a phrase the message must contain)

SPECS_DEFENSE = [
    # dp_gaussian
    ("dp_gaussian:eps=nan", "eps=nan is not a number"),
    ("dp_gaussian:eps=inf", "eps=inf is not finite"),
    ("dp_gaussian:eps=1e400", "eps=1e400 (read as inf) is not finite"),
    ("dp_gaussian:eps=-1", "eps=-1 is out of range; eps must be a finite number in [0.001, 10000]"),
    ("dp_gaussian:eps=0", "eps=0 is out of range"),
    ("dp_gaussian:eps=1e-300", "eps=1e-300 is out of range"),
    ("dp_gaussian:eps=1e9", "eps=1e9 is out of range"),
    ("dp_gaussian:eps=abc", "'abc' is not a valid float"),
    ("dp_gaussian:eps=", "'' is not a valid float"),
    ("dp_gaussian:delta=-1", "delta=-1 is out of range; delta must be a finite number in (0, 1)"),
    ("dp_gaussian:delta=0", "delta=0 is out of range"),
    ("dp_gaussian:delta=1", "delta=1 is out of range"),
    ("dp_gaussian:delta=2", "delta=2 is out of range"),
    ("dp_gaussian:delta=nan", "delta=nan is not a number"),
    ("dp_gaussian:clip=nan", "clip=nan is not a number"),
    ("dp_gaussian:clip=inf", "clip=inf is not finite"),
    ("dp_gaussian:clip=0", "clip=0 is out of range; clip must be a finite number in (0, 1000000]"),
    ("dp_gaussian:clip=-1", "clip=-1 is out of range"),
    ("dp_gaussian:form=fedprox", "'fedprox' is not one of fedavg, fedsgd"),
    # dp_fedlora
    ("dp_fedlora:target_epsilon=nan", "target_epsilon=nan is not a number"),
    ("dp_fedlora:target_epsilon=0", "target_epsilon=0 is out of range"),
    ("dp_fedlora:target_epsilon=-5", "target_epsilon=-5 is out of range"),
    ("dp_fedlora:target_epsilon=inf", "target_epsilon=inf is not finite"),
    ("dp_fedlora:delta=0", "delta=0 is out of range"),
    ("dp_fedlora:delta=1", "delta=1 is out of range"),
    ("dp_fedlora:clip_a=0", "clip_a=0 is out of range"),
    ("dp_fedlora:clip_b=-1", "clip_b=-1 is out of range"),
    ("dp_fedlora:server_lr=0", "server_lr=0 is out of range"),
    ("dp_fedlora:server_lr=nan", "server_lr=nan is not a number"),
    ("dp_fedlora:prox_mu=-1", "prox_mu=-1 is out of range"),
    (
        "dp_fedlora:server_momentum=1",
        "server_momentum=1 is out of range; server_momentum must be a finite number in [0, 1)",
    ),
    ("dp_fedlora:beta1=1.5", "beta1=1.5 is out of range"),
    ("dp_fedlora:beta2=-0.1", "beta2=-0.1 is out of range"),
    ("dp_fedlora:tau=0", "tau=0 is out of range"),
    ("dp_fedlora:sensitivity_factor=0", "sensitivity_factor=0 is out of range"),
    ("dp_fedlora:aggregation=sum", "'sum' is not one of stack, average"),
    ("dp_fedlora:server_opt=sgd", "'sgd' is not one of fedavg"),
    # fedpara, fedper, fedrand, flrsp
    ("fedpara:private_rank=-1", "private_rank=-1 is out of range; private_rank must be an integer in [0, 4096]"),
    ("fedpara:private_rank=1.5", "'1.5' is not a valid int"),
    ("fedpara:private_rank=100000", "private_rank=100000 is out of range"),
    ("fedper:shared_layers=0", "shared_layers=0 is out of range; shared_layers must be an integer in [1, 1000]"),
    ("fedper:shared_layers=-2", "shared_layers=-2 is out of range"),
    ("fedper:shared_layers=2.5", "'2.5' is not a valid int"),
    ("fedper:shared_layers=1000000000000000000000000000000", "is out of range"),
    ("fedper:warmup_round=2", "'2' is not a boolean"),
    ("fedrand:rho=-0.1", "rho=-0.1 is out of range; rho must be a finite number in [0, 1]"),
    ("fedrand:rho=1.5", "rho=1.5 is out of range"),
    ("fedrand:rho=nan", "rho=nan is not a number"),
    ("fedrand:normalize=maybe", "'maybe' is not a boolean"),
    ("flrsp:R=1", "R=1 is out of range; R must be a finite number in [0, 1)"),
    ("flrsp:R=-0.1", "R=-0.1 is out of range"),
    ("flrsp:R=nan", "R=nan is not a number"),
    ("flrsp:R=inf", "R=inf is not finite"),
    ("flrsp:R=-inf", "R=-inf is not finite"),
    ("flrsp:form=fedprox", "'fedprox' is not one of fedavg, fedsgd"),
    # mp_lora, smp_lora, fedavg
    ("mp_lora:lam=-1", "lam=-1 is out of range"),
    ("mp_lora:lam=nan", "lam=nan is not a number"),
    ("mp_lora:proxy_lr=0", "proxy_lr=0 is out of range"),
    ("mp_lora:proxy_weight_decay=-1", "proxy_weight_decay=-1 is out of range"),
    ("mp_lora:proxy_dropout=1", "proxy_dropout=1 is out of range; proxy_dropout must be a finite number in [0, 1)"),
    ("mp_lora:proxy_steps=-1", "proxy_steps=-1 is out of range"),
    ("mp_lora:signal=grad", "'grad' is not one of map, loss"),
    ("smp_lora:delta=0", "delta=0 is out of range"),
    ("smp_lora:delta=-1", "delta=-1 is out of range"),
    ("smp_lora:lam=inf", "lam=inf is not finite"),
    ("fedavg:x=1", "has no parameter 'x'. Valid parameters: none"),
]

SPECS_ATTACK = [
    ("loss_mia:batch_size=0", "batch_size=0 is out of range; batch_size must be an integer in [1, 4096]"),
    ("loss_mia:batch_size=-3", "batch_size=-3 is out of range"),
    ("loss_mia:epochs=0", "epochs=0 is out of range"),
    ("loss_mia:epochs=100000000", "epochs=100000000 is out of range"),
    ("loss_mia:lr=0", "lr=0 is out of range"),
    ("loss_mia:lr=nan", "lr=nan is not a number"),
    ("loss_mia:train_batch=1", "train_batch=1 is out of range"),
    ("loss_mia:hidden=0+3", "every element of hidden must be an integer in [1, 65536]"),
    ("loss_mia:hidden=a", "'a' is not a valid int"),
    ("loss_mia:timesteps=-1", "timesteps=-1 is out of range"),
    ("loss_mia:timesteps=1001", "timesteps=1001 is out of range; timesteps must be an integer in [0, 1000]"),
    ("loss_mia:method=oracle", "'oracle' is not one of threshold, proxy"),
    ("gradient_mia:n_estimators=0", "n_estimators=0 is out of range"),
    (
        "gradient_mia:n_estimators=100000000",
        "n_estimators=100000000 is out of range; n_estimators must be an integer in [1, 10000]",
    ),
    ("gradient_mia:max_depth=0", "max_depth=0 is out of range"),
    ("gradient_mia:learning_rate=0", "learning_rate=0 is out of range"),
    ("gradient_mia:learning_rate=inf", "learning_rate=inf is not finite"),
    ("gradient_mia:batch_size=0", "batch_size=0 is out of range"),
    ("gradient_mia:timesteps=5000", "timesteps=5000 is out of range"),
    ("gradient_mia:use_vmap=sometimes", "'sometimes' is not a boolean"),
    ("inverting_gradients:iterations=0", "iterations=0 is out of range"),
    ("inverting_gradients:iterations=10000000000", "iterations=10000000000 is out of range"),
    ("inverting_gradients:iterations=nan", "'nan' is not a valid int (or none)"),
    ("inverting_gradients:lr=0", "lr=0 is out of range"),
    ("inverting_gradients:tv=-1", "tv=-1 is out of range"),
    ("inverting_gradients:restarts=0", "restarts=0 is out of range"),
    ("inverting_gradients:init=ones", "'ones' is not one of randn, rand, zeros"),
    ("max_renyi:alphas=nan", "alphas=nan is not a number"),
    ("max_renyi:alphas=-1", "every element of alphas must be a number >= 0"),
    ("max_renyi:ks=101", "every element of ks must be an integer in [0, 100]"),
    ("max_renyi:ks=-5", "ks=-5 is out of range"),
    ("max_renyi:primary_k=7", "must be among"),
    ("max_renyi:primary_alpha=nan", "primary_alpha=nan is not a number"),
    ("max_renyi:primary_alpha=-inf", "primary_alpha=-inf is not finite"),
    ("max_renyi:batch_size=0", "batch_size=0 is out of range"),
    ("max_renyi:chunk_rows=0", "chunk_rows=0 is out of range"),
    ("max_renyi:alphas=", "alphas must not be empty"),
    ("max_renyi:alphas=0.5+0.5", "alphas must not repeat a value"),
    ("max_renyi:ks=10+10", "ks must not repeat a value"),
    ("april:driver=qr", "'qr' is not one of gels, gelsy, gelsd, gelss"),
    ("april:boxed=maybe", "'maybe' is not a boolean"),
    # rmia (reference models, [RMIA] / [LiRA])
    ("rmia:n_reference=0", "n_reference=0 is out of range; n_reference must be an integer in [1, "),
    ("rmia:n_reference=1.5", "'1.5' is not a valid int (or none)"),
    ("rmia:gamma=0", "gamma=0 is out of range"),
    ("rmia:gamma=nan", "gamma=nan is not a number"),
    ("rmia:a=2", "a=2 is out of range; a must be a finite number in [0, 1]"),
    ("rmia:a=-0.1", "a=-0.1 is out of range"),
    ("rmia:n_population=0", "n_population=0 is out of range"),
    ("rmia:lira_global_variance=x", "'x' is not a boolean"),
    ("rmia:batch_size=0", "batch_size=0 is out of range"),
    ("rmia:timesteps=-1", "timesteps=-1 is out of range"),
    ("rmia:nope=1", "has no parameter 'nope'"),
]

MALFORMED = [
    (["--defense", "flrsp:R=0.5:R=0.8"], "parameter 'R' is given twice"),
    (["--defense", "flrsp:R"], "'R' is not param=value"),
    (["--defense", "flrsp:=1"], "'=1' is not param=value"),
    (["--defense", ":R=1"], "malformed spec ':R=1'"),
    (["--defense", "flrsp:"], "'' is not param=value"),
    (["--defense", "flrsp::R=0.5"], "'' is not param=value"),
    (["--defense", "flrsp:Q=1"], "Valid parameters: R, form"),
    (["--defense", "flrsp:R=abc"], "'abc' is not a valid float"),
    (["--defense", ""], "no defense given"),
    (["--defense", ","], "no defense given"),
    (["--defense", "nope"], "unknown defense 'nope'"),
    (["--defense", "fedavgg"], "Did you mean 'fedavg'"),
    (["--attack", "nope"], "unknown attack 'nope'"),
    (["--attack", "loss_mia:method"], "'method' is not param=value"),
    (["--attack", "/etc/passwd"], "attack '/etc/passwd' is neither a registered name nor a Python file"),
    (["--attack", "no_such_attack.py"], "attack file 'no_such_attack.py' does not exist"),
    (["--defense", "a\0b.py"], "cannot be read: embedded null byte"),
    (["--defense", "/" + "x" * 300 + ".py"], "cannot be read"),
    (["--defense", "all,fedavg"], "'all' stands alone"),
    # duplicates are rejected, not computed and counted twice
    (["--defense", "fedavg,fedavg"], "fedavg() is given twice"),
    (["--defense", "flrsp,flrsp:R=0.5"], "is given twice"),
    (["--defense", "dp_gaussian:eps=1,dp_gaussian:eps=1.0"], "is given twice"),
    (["--attack", "loss_mia,loss_mia"], "is given twice"),
    (["--attack", "max_renyi,max_renyi:primary_k=10"], "is given twice"),
    (["--scenario", "image-cls,image-cls"], "scenario 'image-cls' is given twice"),
    (["--scenario", "nope"], "unknown scenario 'nope'"),
    (["--scenario", ""], "unknown scenario ''"),
    (["--preset", "huge"], "Valid choices: smoke, default, paper"),
    (["--view", "nope"], "unknown view 'nope'"),
    (["--view", "global"], "Did you mean 'global_model'"),
    (["--view", ","], "Valid choices: global_model, client_model, client_update, released_model, all"),
    (["--view", "client_model,client_model"], "view 'client_model' is given twice"),
    (["--grid", "some"], "invalid choice: 'some'"),
    (["--task", "nope"], "unknown task 'nope'"),
    (["--task", "image-cls/vitt"], "Did you mean 'image-cls/vit'"),
    (["--task", ","], "Valid choices: "),
    (["--scenario", "llm-text", "--task", "image-cls/vit"], "unknown task 'image-cls/vit'"),
    (["--task", "image-cls/vit,image-cls/vit"], "task 'image-cls/vit' is given twice"),
    # seeds
    (["--seeds", "0"], f"--seeds must be a positive integer (at most {MAX_SEEDS}; seeds 0..N-1), a range A-B"),
    (["--seeds", "-1"], "--seeds must be a positive integer"),
    (["--seeds", "1001"], "got '1001'"),
    (["--seeds", "100000000000000"], "got '100000000000000'"),
    (["--seeds", "2-1"], f"distinct seeds in 0..{MAX_SEEDS - 1}, got '2-1'"),
    (["--seeds", "1,1"], "got '1,1'"),
    (["--seeds", f"{MAX_SEEDS}-{MAX_SEEDS}"], f"got '{MAX_SEEDS}-{MAX_SEEDS}'"),
    (["--seeds", "a-b"], "got 'a-b'"),
    (["--seeds", "abc"], "got 'abc'"),
    (["--seeds", "1.5"], "got '1.5'"),
    (["--seeds", ""], "got ''"),
    # the engine's flags (worker processes, budgets, devices)
    (["--jobs", "0"], "--jobs must be > 0 and finite, got '0'"),
    (["--jobs", "-1"], "--jobs must be > 0"),
    (["--jobs", "257"], "--jobs must be at most 256, got 257"),
    (["--jobs", "1.5"], "--jobs must be a whole number, got '1.5'"),
    (["--jobs", ""], "--jobs must be a whole number, got ''"),
    (["--cell-timeout", "0"], "--cell-timeout must be > 0 and finite, got '0'"),
    (["--cell-timeout", "-5"], "--cell-timeout must be > 0"),
    (["--cell-timeout", "nan"], "--cell-timeout must be > 0 and finite, got 'nan'"),
    (["--cell-timeout", "inf"], "--cell-timeout must be > 0 and finite, got 'inf'"),
    (["--cell-timeout", "1e400"], "got '1e400'"),
    (["--cell-timeout", "soon"], "--cell-timeout must be a number, got 'soon'"),
    (["--mem-cap", "-5"], "--mem-cap must be >= 0 and finite, got '-5'"),
    (["--mem-cap", "1.5"], "--mem-cap must be a whole number, got '1.5'"),
    (["--mem-cap", "inf"], "--mem-cap must be a whole number"),
    (["--mem-cap", "lots"], "--mem-cap must be a whole number"),
    (["--mem-cap", "1"], "--mem-cap 1 MB is below the address space a worker needs"),
    (["--mem-cap", "99999999999999999999999"], "--mem-cap must be at most 4294967296 MB"),
    (["--executor", "slurm"], "unknown executor 'slurm'. Valid choices: local, ray"),
    (["--executor", ""], "unknown executor ''"),
    (["--ray-address", "ray://h:1"], "--ray-address needs --executor ray"),
    (["--executor", "ray", "--ray-address", " "], "--ray-address must name a running cluster"),
    (["--device", "tpu"], "unknown device 'tpu'. Valid choices: auto, cpu, cuda, cuda:N"),
    (["--device", ""], "unknown device ''"),
    (["--device", "cuda:-1"], "unknown device 'cuda:-1'"),
    (["--device", "cuda:99"], "--device cuda:99: "),  # no CUDA here, or fewer devices
    (["--precision", "fp64"], "unknown precision 'fp64'. Valid choices: fp32, bf16, fp16"),
    (["--precision", ""], "unknown precision ''"),
    (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs a CUDA device"),
    (["--redo-before", "yesterday"], "--redo-before 'yesterday' is not an ISO 8601 date or time: give e.g."),
    (["--redo-before", ""], "--redo-before '' is not an ISO 8601 date or time"),
    (["--redo-before", "2026-13-01"], "is not an ISO 8601 date or time"),
    (["--redo-before", "9999-01-01"], "--redo-before '9999-01-01' is in the future"),
]


def _case_id(args: list[str]) -> str:
    return " ".join(args)[:60] or "empty"


CASES = (
    [pytest.param(["--defense", s], n, id=s) for s, n in SPECS_DEFENSE]
    + [pytest.param(["--attack", s], n, id=s) for s, n in SPECS_ATTACK]
    + [pytest.param(a, n, id=_case_id(a)) for a, n in MALFORMED]
)


@pytest.fixture(autouse=True)
def restore_registries():
    """Path-loaded methods register globally: undo it so every case (and other tests) sees the repository's set."""
    saved = []
    for reg in (DEFENSES, ATTACKS):
        reg.load()
        saved.append((reg, dict(reg._items), dict(reg._paths)))
    mods = {k for k in sys.modules if k.startswith("_bench_contrib_")}
    yield
    for reg, items, paths in saved:
        reg._items.clear()
        reg._items.update(items)
        reg._paths.clear()
        reg._paths.update(paths)
    for k in [k for k in sys.modules if k.startswith("_bench_contrib_") and k not in mods]:
        del sys.modules[k]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder (the CLI's cwd) and an --out inside it that must stay absent; the machine-wide cache
    ($BENCH_CACHE) points inside it too, so a rejected command that wrote there would show."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BENCH_QUIET", "1")
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "bench-cache"))
    return tmp_path


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.err


def assert_rejected(code: int, err: str, needle: str, sandbox: Path, before: set[str]) -> None:
    assert code == 2, err
    assert needle in err, err
    assert err.startswith("error: ") or "usage:" in err, err
    assert "Traceback" not in err
    assert set(os.listdir(sandbox)) == before, "something was written"


@pytest.mark.parametrize("args, needle", CASES)
def test_bad_run_input_exits_2_with_the_problem_and_writes_nothing(args, needle, sandbox, capsys):
    before = set(os.listdir(sandbox))

    # one cheap valid configuration; the case's own arguments come last and win (argparse keeps the last)
    base = [
        "run",
        "--preset",
        "smoke",
        "--scenario",
        "image-cls",
        "--defense",
        "fedavg",
        "--attack",
        "loss_mia",
        "--out",
        "out",
    ]

    code, err = run_cli([*base, *args], capsys)

    assert_rejected(code, err, needle, sandbox, before)
    assert not (sandbox / "out").exists()


# ----------------------------------------------------------------------------------------------
# --out


OUT_CASES = [
    ("", "--out must name a directory; got an empty string"),
    ("  ", "--out must name a directory"),
    ("a_file", "--out 'a_file' is an existing file, not a directory"),
    ("a_file/sub/dir", "is under 'a_file', which is a file"),
    ("/proc/bench-out", "is not a writable directory"),
    ("out\0x", "contains a NUL character"),
    ("x" * 300, "is not a writable directory (File name too long)"),
]


@pytest.mark.parametrize(
    "out, needle", OUT_CASES, ids=["empty", "blank", "file", "under-a-file", "proc", "nul", "too-long"]
)
def test_bad_out_is_rejected_before_any_work(out, needle, sandbox, capsys):
    (sandbox / "a_file").write_text("x")
    before = set(os.listdir(sandbox))

    code, err = run_cli(
        [
            "run",
            "--preset",
            "smoke",
            "--scenario",
            "image-cls",
            "--defense",
            "fedavg",
            "--attack",
            "loss_mia",
            "--out",
            out,
        ],
        capsys,
    )

    assert_rejected(code, err, needle, sandbox, before)
    assert (sandbox / "a_file").read_text() == "x"


def test_an_out_the_write_probe_cannot_write_is_rejected_even_as_root(sandbox, capsys, monkeypatch):
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)  # what a read-only folder does to anyone but root

    code, err = run_cli(["run", "--preset", "smoke", "--out", "ro/out"], capsys)

    assert_rejected(code, err, "--out 'ro/out' is not a writable directory (Permission denied)", sandbox, set())


@pytest.mark.parametrize("sub", ["records", "cache", "artifacts", "quarantine", "leaderboards"])
@pytest.mark.parametrize("command", ["run", "leaderboard"])
def test_a_file_where_out_keeps_a_folder_is_rejected_before_any_work(sub, command, sandbox, capsys):
    (sandbox / "out").mkdir()
    (sandbox / "out" / sub).write_text("x")
    if sub != "records":
        (sandbox / "out" / "records").mkdir()
    before = set(os.listdir(sandbox / "out"))
    args = ["run", "--preset", "smoke", "--scenario", "image-cls", "--defense", "fedavg", "--attack", "loss_mia"]

    code, err = run_cli([*(args if command == "run" else ["leaderboard"]), "--out", "out"], capsys)

    assert_rejected(code, err, f"--out 'out' holds a file '{sub}' where a run keeps its {sub} folder", sandbox, {"out"})
    assert set(os.listdir(sandbox / "out")) == before and (sandbox / "out" / sub).read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_is_rejected(sandbox, capsys):
    ro = sandbox / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = run_cli(["run", "--preset", "smoke", "--out", str(ro / "out")], capsys)
    finally:
        ro.chmod(0o755)

    assert code == 2 and "is not a writable directory" in err
    assert not (ro / "out").exists()


OTHER_COMMANDS = [
    (["leaderboard", "--out", ""], "--out must name a directory"),
    (["leaderboard", "--out", "none"], "no records under"),
    (["check", "--defense", "dp_gaussian:eps=nan"], "eps=nan is not a number"),
    (["check", "--defense", "/etc/passwd"], "is neither a registered name nor a Python file"),
    (["check", "--defense", "fedavg", "--scenario", "nope"], "unknown scenario 'nope'"),
    (["list", "--preset", "huge"], "Valid choices: smoke, default, paper"),
    (["list", "--scenario", "nope"], "unknown scenario 'nope'"),
    (["list", "--scenario", "image-cls,image-cls"], "scenario 'image-cls' is given twice"),
    (["check", "--defense", "fedavg,fedavg"], "is given twice"),
    (["check", "--defense", "fedavg", "--timeout", "0"], "--timeout must be > 0 and finite, got '0'"),
    (["check", "--defense", "fedavg", "--timeout", "nan"], "--timeout must be > 0 and finite, got 'nan'"),
    (["check", "--attack", ""], "no attack given"),
    (["check", "--attack", "rmia:a=2"], "a=2 is out of range"),
    (["leaderboard", "--out", "a_file"], "--out 'a_file' is an existing file, not a directory"),
    (["leaderboard", "--out", "o", "--restore", "nowhere"], "--restore 'nowhere' is not a directory"),
    (["leaderboard", "--out", "o", "--restore", "."], "holds no published records"),
    (["leaderboard", "--out", "o", "--restore", ".", "--publish", "p"], "not allowed with argument"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("args, needle", OTHER_COMMANDS, ids=[_case_id(a) for a, _ in OTHER_COMMANDS])
def test_other_commands_reject_bad_input(args, needle, sandbox, capsys):
    (sandbox / "a_file").write_text("x")
    before = set(os.listdir(sandbox))

    code, err = run_cli(args, capsys)

    assert_rejected(code, err, needle, sandbox, before)


# ----------------------------------------------------------------------------------------------
# environment variables the CLI reads


ENV_CASES = [
    ("BENCH_THREADS", "abc", ["list"], "BENCH_THREADS must be a whole number, got 'abc'"),
    ("BENCH_THREADS", "0", ["run", "--preset", "smoke", "--out", "out"], "BENCH_THREADS must be > 0 and finite"),
    ("BENCH_THREADS", "-2", ["check", "--defense", "fedavg"], "BENCH_THREADS must be > 0"),
    ("BENCH_THREADS", "1.5", ["leaderboard", "--out", "out"], "BENCH_THREADS must be a whole number, got '1.5'"),
    ("BENCH_CHECK_BUDGET_S", "abc", ["check", "--defense", "fedavg"], "BENCH_CHECK_BUDGET_S must be a positive"),
    ("BENCH_CHECK_BUDGET_S", "0", ["check", "--defense", "fedavg"], "number of seconds, got '0'"),
    ("BENCH_CHECK_BUDGET_S", "nan", ["check", "--attack", "loss_mia"], "number of seconds, got 'nan'"),
    ("BENCH_CHECK_BUDGET_S", "-5", ["check", "--defense", "fedavg"], "number of seconds, got '-5'"),
    ("BENCH_CHECK_BUDGET_S", "inf", ["check", "--defense", "fedavg"], "number of seconds, got 'inf'"),
]


@pytest.mark.parametrize("env, value, args, needle", ENV_CASES, ids=[f"{e}={v}" for e, v, _, _ in ENV_CASES])
def test_bad_environment_variables_exit_2(env, value, args, needle, sandbox, capsys, monkeypatch):
    monkeypatch.delenv("BENCH_THREADS", raising=False)  # a valid one would change this process's torch threads
    monkeypatch.setenv(env, value)
    for mod in ("bench.conformance", "bench.conformance_defense"):  # the budget is read when they are imported
        monkeypatch.delitem(sys.modules, mod, raising=False)
    before = set(os.listdir(sandbox))

    code, err = run_cli(args, capsys)

    assert_rejected(code, err, needle, sandbox, before)


def test_the_table_holds_at_least_the_issues_134_cases():
    n = len(CASES) + len(OUT_CASES) + 2 + 10 + len(OTHER_COMMANDS) + len(ENV_CASES) + 2 * len(CONTRIB_IDS)

    assert n >= 134 + 60  # the issue's 134, and the engine's, the environment's and the contributed files' since


# ----------------------------------------------------------------------------------------------
# contributed files: every way one can be wrong is exit 2 in `run` and in `check`

GOOD = """
from dataclasses import dataclass
from bench.fl import fedavg_aggregate, standard_message
from bench.registry import register_defense
from bench.types import Defense
{extra_import}

@register_defense
@dataclass
class {cls}(Defense):
    keep: float = {default}
    grid = {grid}
{body}
    def client_step(self, state, ctx):
        return standard_message(state, ctx)

    def aggregate(self, global_state, msgs, ctx):
        return fedavg_aggregate(global_state, msgs, ctx)
"""


def contributed(
    folder: Path,
    name: str,
    *,
    cls: str = "Mine",
    default: str = "0.5",
    grid: str = "({},)",
    body: str = "",
    extra_import: str = "",
) -> Path:
    path = folder / name
    path.write_text(
        textwrap.dedent(GOOD).format(
            cls=cls,
            default=default,
            grid=grid,
            extra_import=extra_import,
            body=textwrap.indent(textwrap.dedent(body), "    "),
        )
    )
    return path


def _contrib_cases(d: Path) -> list[tuple[str, str]]:
    (d / "notes.txt").write_text("not python")
    (d / "syntax_error.py").write_text("def broken(:\n    pass\n")
    (d / "plugins").mkdir()
    return [
        ("/etc/passwd", "'/etc/passwd' is neither a registered name nor a Python file (.py)"),
        (str(d / "notes.txt"), "is neither a registered name nor a Python file"),
        (str(d / "missing.py"), "does not exist"),
        (str(d / "plugins"), "is neither a registered name nor a Python file"),
        (str(d / "syntax_error.py"), "does not import: SyntaxError: invalid syntax (line 1)"),
        (
            str(contributed(d, "missing_import.py", extra_import="import no_such_module_xyz")),
            "does not import: ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
        (str(contributed(d, "fedavg.py")), "defense 'fedavg' is already registered by defenses.fedavg"),
        (str(contributed(d, "exits.py", extra_import="raise SystemExit(0)")), "it called sys.exit(0) while importing"),
        (str(contributed(d, "raises.py", extra_import="1 / 0")), "does not import: ZeroDivisionError"),
        (str(d / "nothing.py"), "must register exactly one defense; it registered none"),
        (str(contributed(d, "bad_grid.py", grid="({'keep': 0.5}, {'keep': 'lots'})")), "'lots' is not a valid float"),
        (str(contributed(d, "bad_grid_key.py", grid="({'kep': 0.5},)")), "has no parameter 'kep'"),
        (str(contributed(d, "grid_not_tuple.py", grid="{'keep': 0.5}")), "grid must be a non-empty tuple"),
        (str(contributed(d, "nan_default.py", default="float('nan')")), "keep=nan is not a number"),
        (
            str(
                contributed(
                    d,
                    "ranged_default.py",
                    default="param(2.0, ge=0.0, le=1.0)",
                    extra_import="from bench.params import param",
                )
            ),
            "keep=2.0 is out of range; keep must be a finite number in [0, 1]",
        ),
        (
            str(
                contributed(d, "post_init_raises.py", body="def __post_init__(self):\n    raise RuntimeError('boom')\n")
            ),
            "RuntimeError: boom",
        ),
        (str(contributed(d, "ok_twice.py")) + "," + str(d / "ok_twice.py"), "is given twice"),
        (
            str(contributed(d, "bad_annotation.py", body="extra: 'NoSuchType' = 1\n")),
            "the types of its fields cannot be read (NameError",
        ),
    ]


CONTRIB_IDS = [
    "etc-passwd",
    "txt",
    "missing",
    "directory",
    "syntax",
    "missing-import",
    "collides-builtin",
    "sys-exit",
    "raises",
    "registers-nothing",
    "bad-grid-value",
    "bad-grid-key",
    "grid-not-tuple",
    "nan-default",
    "out-of-range-default",
    "post-init-raises",
    "same-path-twice",
    "bad-annotation",
]


@pytest.mark.parametrize("which", range(len(CONTRIB_IDS)), ids=CONTRIB_IDS)
@pytest.mark.parametrize("command", ["run", "check"])
def test_broken_contributed_file_is_a_usage_error(which, command, sandbox, capsys):
    (sandbox / "nothing.py").write_text("x = 1\n")
    spec, needle = _contrib_cases(sandbox)[which]
    before = set(os.listdir(sandbox))
    args = (
        ["run", "--preset", "smoke", "--scenario", "image-cls", "--attack", "loss_mia", "--out", "out"]
        if command == "run"
        else ["check", "--scenario", "image-cls"]
    )

    code, err = run_cli([*args, "--defense", spec], capsys)

    assert_rejected(code, err, needle, sandbox, before)


def test_same_contributed_file_is_imported_once(sandbox):
    path = contributed(sandbox, "once.py")

    first, second = DEFENSES.get(str(path)), DEFENSES.get(str(sandbox / "." / "once.py"))

    assert first is second


def test_rejected_contributed_file_leaves_the_registry_and_a_namesake_alone(sandbox):
    (sandbox / "a").mkdir()
    (sandbox / "b").mkdir()
    good = DEFENSES.get(str(contributed(sandbox / "a", "twin.py")))
    names = DEFENSES.names()

    with pytest.raises(UsageError, match="already registered"):
        DEFENSES.get(str(contributed(sandbox / "b", "twin.py", cls="Other")))

    assert DEFENSES.names() == names
    assert sys.modules[good.__module__].Mine is good


# ----------------------------------------------------------------------------------------------
# declared ranges: every registered method, every numeric field


def _numeric_fields():
    for reg in (DEFENSES, ATTACKS):
        for name, cls in reg.items():
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if f.init and f.name in hints and range_of(f, hints[f.name]) is not None:
                    yield pytest.param(reg, name, f.name, id=f"{name}:{f.name}")


@pytest.mark.parametrize("reg, name, field", list(_numeric_fields()))
def test_every_numeric_field_rejects_nan_and_its_default_is_in_range(reg, name, field):
    cls = reg.get(name)

    with pytest.raises(UsageError, match=rf"{field}(=nan is not a number|: 'nan' is not a valid int)"):
        expand(reg, f"{name}:{field}=nan")
    build(cls, {}, reg.kind)  # the defaults pass their own declared ranges


def test_every_numeric_field_of_a_registered_method_declares_its_range_beside_the_field():
    from bench.params import RANGE_KEY

    undeclared = [
        f"{name}.{f.name}"
        for reg in (DEFENSES, ATTACKS)
        for name, cls in reg.items()
        for f in dataclasses.fields(cls)
        if f.init
        and range_of(f, typing.get_type_hints(cls).get(f.name, object)) is not None
        and RANGE_KEY not in (f.metadata or {})
    ]

    assert len(list(_numeric_fields())) > 40
    assert not undeclared, f"numeric fields on the generic rule only (declare them with param(...)): {undeclared}"


def test_param_declares_a_range_and_the_generic_rule_covers_undeclared_fields():
    @dataclasses.dataclass
    class M:
        name = "m"
        p: float = param(0.5, gt=0.0, lt=1.0)
        q: float = 1.0
        n: int = 3
        ts: tuple[float, ...] = param((1.0, math.inf), ge=0.0, allow_inf=True)

    f = {x.name: x for x in dataclasses.fields(M)}

    assert field_problem(f["p"], float, 1.0) == "out of range; p must be a finite number in (0, 1)"
    assert field_problem(f["p"], float, 0.999) is None
    assert field_problem(f["q"], float, math.inf) == "not finite; q must be a finite number"
    assert field_problem(f["q"], float, -1e300) is None
    assert field_problem(f["n"], int, -1) == "out of range; n must be an integer in [0, 2147483647]"
    assert field_problem(f["n"], int, True) == "of the wrong type: expected an integer, got bool"
    assert field_problem(f["n"], int, 2.5) == "of the wrong type: expected an integer, got float"
    assert field_problem(f["ts"], tuple[float, ...], (0.5, math.inf)) is None
    assert "not finite" in field_problem(f["ts"], tuple[float, ...], (-math.inf,))
    with pytest.raises(UsageError, match=r"'m': p=0 is out of range"):
        build(M, {"p": "0"}, "defense")
    with pytest.raises(UsageError, match=r"n=2.5 is of the wrong type"):
        build(M, {"n": 2.5}, "defense")  # a grid entry of the wrong type


# ----------------------------------------------------------------------------------------------
# what a defense reports: NaN / negative / infinite epsilon fails the cell


@pytest.mark.parametrize(
    "privacy, needle",
    [
        ({"epsilon": float("nan")}, "epsilon=nan"),
        ({"epsilon": -1.0}, "epsilon=-1.0"),
        ({"epsilon": math.inf}, "epsilon=inf"),
        ({"epsilon": 1.0, "epsilon_composed": -0.5}, "epsilon_composed=-0.5"),
        ({"epsilon": "inf"}, "epsilon='inf'"),
        ({"epsilon": 1.0, "delta": 2.0}, "delta=2.0"),
    ],
)
def test_check_privacy_rejects_bad_epsilons(privacy, needle):
    with pytest.raises(ValueError, match=needle):
        check_privacy(privacy, "mine")


def test_check_privacy_accepts_none_and_finite_non_negative():
    check_privacy({"epsilon": None, "epsilon_composed": None, "delta": None}, "fedavg")
    check_privacy(
        {"epsilon": 0.0, "epsilon_composed": 3.5, "epsilon_composed_no_amplification": 7, "delta": 1e-5}, "dp"
    )


@pytest.mark.parametrize("eps", [float("nan"), -1.0, math.inf])
def test_defense_reporting_a_bad_epsilon_fails_its_cells_with_the_reason(eps, tmp_path):
    from bench.runner import run
    from defenses.fedavg import FedAvg
    from tests.toy import ToyLossMIA, toy_task

    @dataclasses.dataclass
    class BadEps(FedAvg):
        name = "bad_eps"

        def epsilon(self, *, delta):
            return eps

    summary = run([toy_task(rounds=1)], [BadEps()], [ToyLossMIA()], [0], tmp_path)

    import json

    recs = [json.loads(p.read_text()) for p in (tmp_path / "records").glob("*/*.json")]
    mine = [r for r in recs if r["defense"] == "bad_eps"]
    assert mine and all(r["status"] == "failed" for r in mine)
    assert all(f"reported epsilon={eps!r}" in r["reason"] for r in mine)
    assert all(r["status"] == "ok" for r in recs if r["defense"] == "base")  # the rest of the matrix ran
    assert summary.counts["failed"] == len(mine)


def test_defense_whose_applies_raises_fails_its_cells_and_planning_goes_on(tmp_path):
    from bench.runner import plan, run
    from defenses.fedavg import FedAvg
    from tests.toy import ToyMeanRecon, toy_task

    @dataclasses.dataclass
    class Exploding(FedAvg):
        name = "exploding"

        def applies(self, task):
            raise RuntimeError("applies exploded")

    task = toy_task(n=32)

    cells = plan([task], [Exploding(), FedAvg()], [ToyMeanRecon()], [0])
    summary = run([task], [Exploding()], [ToyMeanRecon()], [0], tmp_path)

    broken = [c for c in cells if c.defense is not None and c.defense.name == "exploding"]
    assert broken and all("exploding.applies() raised RuntimeError: applies exploded" in c.error for c in broken)
    assert all(c.error is None for c in cells if c.defense is not None and c.defense.name == "fedavg")
    assert summary.counts["failed"] == len(broken)
    import json

    recs = [json.loads(p.read_text()) for p in (tmp_path / "records").glob("*/*.json")]
    assert [r["status"] for r in recs] == ["failed"] * len(broken)
    assert "applies exploded" in recs[0]["reason"]


# ----------------------------------------------------------------------------------------------
# one case through a real process: exit code 2, the message, no traceback, nothing written


def test_subprocess_bad_contributed_file_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "syntax_error.py"
    bad.write_text("def broken(:\n")
    env = {**os.environ, "BENCH_QUIET": "1", "PYTHONPATH": str(ROOT)}

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "run",
            "--preset",
            "smoke",
            "--defense",
            f"{bad},dp_gaussian:eps=nan",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )

    assert res.returncode == 2, res.stderr
    assert "does not import: SyntaxError" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
