"""Round checkpoints (bench/checkpoint.py): a stopped run resumes to the uninterrupted run's result."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from bench.checkpoint import ENV, Checkpoint, from_plain, interval, restored_share, to_plain
from bench.fl import ClientState, run_federated
from bench.server_opt import Scaffold
from bench.training import cache_stem, get_training
from defenses.dp_gaussian import DPGaussian
from defenses.fedavg import FedAvg
from defenses.fedsgd import FedSGD
from tests.toy import toy_task


class Stop(Exception):
    pass


class StopAfterSave(Checkpoint):
    def save(self, state):
        super().save(state)
        raise Stop


def same(a, b) -> bool:
    return (
        a.global_state.keys() == b.global_state.keys()
        and all(torch.equal(a.global_state[n], b.global_state[n]) for n in a.global_state)
        and a.client_latest.keys() == b.client_latest.keys()
        and all(
            torch.equal(a.client_latest[k][n], b.client_latest[k][n])
            for k in a.client_latest
            for n in a.client_latest[k]
        )
        and (a.transcript, a.bytes_down, a.logs) == (b.transcript, b.bytes_down, b.logs)
    )


@pytest.mark.parametrize(
    "defense, optimizer",
    [(FedAvg(), "sgd"), (DPGaussian(), "sgd"), (FedSGD(), "adam")],  # adam: the server's moments (fl.server_step)
    ids=["fedavg", "dp_gaussian", "fedsgd-adam"],
)
def test_a_run_stopped_after_a_round_resumes_to_the_uninterrupted_result(tmp_path, defense, optimizer):
    # arrange
    task = toy_task(rounds=3)
    task = replace(task, fl=replace(task.fl, optimizer=optimizer))
    _, whole = run_federated(task, defense, 3)
    path = tmp_path / "run.ckpt"
    # act: stopped right after round 1's checkpoint; the global RNG is disturbed before resuming
    with pytest.raises(Stop):
        run_federated(task, defense, 3, checkpoint=StopAfterSave(path, "k", 0.0))
    torch.manual_seed(12345)
    _, resumed = run_federated(task, defense, 3, checkpoint=Checkpoint(path, "k", math.inf))
    # assert
    assert same(whole, resumed)
    assert len(resumed.bytes_down) == len(whole.bytes_down) > 1


def test_an_unusable_checkpoint_is_deleted_with_a_warning_and_the_run_starts_over(tmp_path, capsys):
    # arrange
    task = toy_task(rounds=2)
    _, whole = run_federated(task, FedAvg(), 0)
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(b"not a checkpoint")
    foreign = tmp_path / "foreign.ckpt"
    with pytest.raises(Stop):
        run_federated(task, FedAvg(), 1, checkpoint=StopAfterSave(foreign, "seed1", 0.0))
    # act
    _, from_damaged = run_federated(task, FedAvg(), 0, checkpoint=Checkpoint(damaged, "seed0", math.inf))
    _, from_foreign = run_federated(task, FedAvg(), 0, checkpoint=Checkpoint(foreign, "seed0", math.inf))
    # assert
    err = capsys.readouterr().err
    assert "checkpoint damaged.ckpt not used" in err and "training from round 1" in err
    assert "checkpoint foreign.ckpt not used" in err and "belongs to training run 'seed1'" in err
    assert same(whole, from_damaged) and same(whole, from_foreign)
    assert not damaged.exists() and not foreign.exists()


def test_get_training_checkpoints_between_rounds_and_deletes_the_file_when_done(tmp_path, monkeypatch):
    # arrange: a checkpoint after every round; the second round sees the first one on disk
    monkeypatch.setenv(ENV, "0")
    task = toy_task(rounds=2)
    stem = cache_stem(task, FedAvg(), 0, tmp_path)
    seen = []
    saved = Checkpoint.save

    def spy(self, state):
        saved(self, state)
        seen.append((self.path.name, self.path.exists()))

    monkeypatch.setattr(Checkpoint, "save", spy)
    # act
    res = get_training(task, FedAvg(), 0, tmp_path)
    # assert
    assert seen == [(stem.name + ".ckpt", True)]  # after round 1 only: the last round is cached instead
    assert not list(stem.parent.glob("*.ckpt"))
    assert len(res.bytes_down) == 2


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_checkpoint_interval_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=ENV):
        interval()


def test_objects_in_a_defenses_state_are_saved_as_state_dicts_and_loaded_into_fresh_ones(tmp_path):
    # arrange: what a defense may keep in DefenseRun.state, after some steps
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.tensor([1.0, -2.0, 3.0])
    opt.step()
    scaffold = Scaffold()
    scaffold.c = {"w": torch.tensor([0.5, 0.25, 0.0])}
    state = {"opt": opt, "server_opt": scaffold, "log": [1, (2.0, "x")]}
    torch.save(to_plain(state), tmp_path / "s.pt")
    fresh_w = torch.nn.Parameter(torch.ones(3))
    fresh = {"opt": torch.optim.Adam([fresh_w], lr=0.1), "server_opt": Scaffold()}
    # act
    back = from_plain(torch.load(tmp_path / "s.pt", weights_only=True), fresh)
    # assert
    assert back["opt"] is fresh["opt"] and back["server_opt"] is fresh["server_opt"]
    assert torch.equal(back["opt"].state[fresh_w]["exp_avg"], opt.state[w]["exp_avg"])
    assert torch.equal(back["server_opt"].c["w"], scaffold.c["w"]) and back["log"] == [1, (2.0, "x")]
    with pytest.raises(ValueError, match=r"state\['opt'\]: a saved object's state but no object"):
        from_plain(to_plain({"opt": opt}), {})


class Unsaveable(FedAvg):
    def client_step(self, state: ClientState, ctx):
        state.private["hook"] = lambda: None  # not plain data: this run cannot be checkpointed
        return super().client_step(state, ctx)


def test_a_run_whose_state_cannot_be_saved_trains_on_without_checkpoints_and_says_why(tmp_path, capsys):
    task = toy_task(rounds=2)
    _, whole = run_federated(task, Unsaveable(), 0)

    _, res = run_federated(task, Unsaveable(), 0, checkpoint=Checkpoint(tmp_path / "run.ckpt", "k", 0.0))

    assert same(whole, res) and not (tmp_path / "run.ckpt").exists()
    err = capsys.readouterr().err
    assert "no round checkpoints for this run: state['privates'][0]['hook']: a function cannot be checkpointed" in err


def test_the_plan_counts_the_training_runs_that_resume_from_a_checkpoint(tmp_path, capsys):
    # arrange: a checkpoint where the smoke fedsgd run of image-cls/vit would train
    from bench.cli import main
    from bench.registry import SCENARIOS, build
    from bench.training import checkpoint_path

    out = tmp_path / "out"
    task = next(t for t in SCENARIOS.get("image-cls")("smoke") if t.variant == "vit")
    path = checkpoint_path(task, build(FedSGD, {}, "defense"), 0, out / "cache")
    path.parent.mkdir(parents=True)
    torch.save({"format": 1, "key": path.stem, "state": {"kind": "round", "next_round": 1, "rounds": 4}}, path)
    saved = path.read_bytes()
    argv = ["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "april", "--preset", "smoke"]
    # act
    code = main([*argv, "--out", str(out), "--dry-run"])
    # assert: a quarter of the training run is in the checkpoint, out of the work left
    text = capsys.readouterr().out
    assert code == 0 and "1 to train (0 cached, 1 resume from a checkpoint)" in text
    assert "of work left, " in text and " more done in checkpoints" in text
    assert path.read_bytes() == saved  # a dry run reads, never deletes


def test_a_second_run_training_the_same_entry_waits_and_reads_the_first_ones(tmp_path, monkeypatch):
    # arrange: a slow training whose calls are counted, started by two threads (as two runs on one --out)
    import threading
    import time

    import bench.training as training

    task, defense, trained = toy_task(), FedAvg(), []
    real = training._train

    def slow(*args, **kwargs):
        trained.append(threading.get_ident())
        time.sleep(0.5)  # the second caller arrives while this one holds the entry's lock
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "_train", slow)
    results: list = []
    runs = [threading.Thread(target=lambda: results.append(get_training(task, defense, 0, tmp_path))) for _ in range(2)]

    # act
    for t in runs:
        t.start()
        time.sleep(0.1)
    for t in runs:
        t.join(120)

    # assert: trained once; the other caller read the entry the first one wrote
    assert len(trained) == 1 and len(results) == 2
    a, b = results
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    assert cache_stem(task, defense, 0, tmp_path).with_suffix(".json").exists()
    assert not list(tmp_path.rglob("*.lock"))  # the lock files go with their holders


def test_the_entry_lock_admits_one_holder_at_a_time_and_leaves_no_file(tmp_path):
    # arrange: four threads taking the same entry's lock, each noting how many hold it at once
    import threading
    import time

    from bench import cachefile

    stem, inside, most, lock = tmp_path / "entry", [0], [0], threading.Lock()

    def hold():
        with cachefile.building(stem):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(4)]

    # act
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    # assert
    assert most[0] == 1 and not any(t.is_alive() for t in threads)
    assert not (tmp_path / "entry.lock").exists()


def test_a_resumed_run_reports_its_restored_rounds_as_done_before_this_run(tmp_path):
    from bench.progress import Resumed, unit_progress

    # arrange: a run stopped after round 0's checkpoint
    task = toy_task(rounds=3)
    path = tmp_path / "run.ckpt"
    with pytest.raises(Stop):
        run_federated(task, FedAvg(), 3, checkpoint=StopAfterSave(path, "k", 0.0))
    reports: list = []
    # act
    with unit_progress(reports.append):
        run_federated(task, FedAvg(), 3, checkpoint=Checkpoint(path, "k", math.inf))
    # assert: the restored third comes first, as done before; the live fractions follow it
    assert reports[0] == Resumed(1 / 3)
    assert all(isinstance(f, float) for f in reports[1:]) and reports[1:]


def test_the_share_of_its_run_a_checkpoint_holds_is_read_for_the_plan(tmp_path):
    # arrange: a run stopped after round 0 of 3; a damaged file; another run's checkpoint under this name
    task = toy_task(rounds=3)
    path, damaged, foreign = tmp_path / "k.ckpt", tmp_path / "d.ckpt", tmp_path / "f.ckpt"
    with pytest.raises(Stop):
        run_federated(task, FedAvg(), 3, checkpoint=StopAfterSave(path, "k", 0.0))
    damaged.write_bytes(path.read_bytes()[:100])
    foreign.write_bytes(path.read_bytes())
    # act / assert: a third restored; the others would not be used by their run, so none
    assert restored_share(path) == pytest.approx(1 / 3)
    assert restored_share(damaged) == restored_share(foreign) == restored_share(tmp_path / "none.ckpt") == 0.0


def test_the_plan_counts_the_cells_a_killed_run_left_spilled_model_passes_of(tmp_path, capsys):
    # arrange: a marker saying a killed smoke loss_mia cell of image-cls/vit had spilled passes for 40% of its work
    from attacks.loss_mia import LossMIA
    from bench.cli import main
    from bench.matrix import Cell
    from bench.registry import SCENARIOS, build
    from bench.signal_cache import marker_path, write_marker

    out = tmp_path / "out"
    task = next(t for t in SCENARIOS.get("image-cls")("smoke") if t.variant == "vit")
    cell = Cell(task, build(FedSGD, {}, "defense"), LossMIA(), "global_model", 0)
    write_marker(marker_path(out / "cache", cell.id), 0.4)
    argv = ["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "loss_mia", "--preset", "smoke"]

    # act
    code = main([*argv, "--view", "global_model", "--out", str(out), "--dry-run"])

    # assert: the cell is still to run, its spilled share out of the work left
    text = capsys.readouterr().out
    assert code == 0 and " to run (1 resume from spilled model passes)" in text
    assert " more done in checkpoints" in text
