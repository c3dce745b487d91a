"""Fault injection on the harness (issue 13): damaged records and caches are quarantined and redone, planted
pickles never run, and kill -9 at random points followed by resume loses or tears nothing.

The engine's own faults (hanging, exiting, memory-hungry contributed code) are in tests/test_engine.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench import training
from bench.cli import main
from bench.fl import TrainingDiverged, run_federated
from bench.runner import plan, run
from bench.store import Store
from bench.types import Attack, Reconstructions
from defenses.fedavg import FedAvg
from tests.fault_run import matrix
from tests.toy import ToyLossMIA, ToyMeanRecon, toy_task

ROOT = Path(__file__).resolve().parent.parent
# What legitimately differs between two runs of one cell: wall times, memory, when it started, the machine's
# speed probe (a timing too).
VOLATILE = {
    ("cost", "train_wall_s"),
    ("cost", "attack_wall_s"),
    ("cost", "peak_mem_mb"),
    ("provenance", "started_at"),
    ("provenance", "dirty"),
    ("provenance", "machine"),
}


def comparable(rec: dict) -> dict:
    out = {k: v for k, v in rec.items() if k != "traceback"}
    for a, b in VOLATILE:
        if isinstance(out.get(a), dict):
            out[a] = {k: v for k, v in out[a].items() if k != b}
    return out


def differences(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ (for failure messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def by_id(out: Path) -> dict[str, dict]:
    return {r["cell_id"]: comparable(r) for r in Store(out).records()}


class Payload:
    """Unpickling this writes ``marker`` (what a planted cache file would do with real code)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def small_run(out: Path, attacks=None):
    task = toy_task()
    defenses, attacks = [FedAvg()], attacks or [ToyLossMIA(), ToyMeanRecon()]
    summary = run([task], defenses, attacks, [0], out)
    return task, defenses[0], summary, len(plan([task], defenses, attacks, [0]))


def test_damaged_records_are_quarantined_and_only_their_cells_redone(tmp_path, capsys, monkeypatch):
    _, _, _, n = small_run(tmp_path)
    before = by_id(tmp_path)
    files = sorted((tmp_path / "records").glob("*/*.json"))
    damage = [b"\x8f\x00random", b"[]", b'{"status": "ok"}']
    for f, raw in zip(files, damage):
        f.write_bytes(raw)
    garbage = json.loads(files[3].read_text())
    metric = next(iter(garbage.get("metrics") or {"auroc": None}))
    garbage["metrics"] = {metric: {"value": "garbage"}}
    garbage["status"] = "ok"
    files[3].write_text(json.dumps(garbage))
    mtimes = {f: f.stat().st_mtime_ns for f in files[4:]}

    monkeypatch.delenv("BENCH_THREADS", raising=False)  # main() would change torch's threads (and BLAS rounding)
    code = main(["leaderboard", "--out", str(tmp_path)])  # skips and reports them, no traceback
    err = capsys.readouterr().err
    _, _, summary, _ = small_run(tmp_path)  # and run redoes their cells

    assert code == 0 and all(f"quarantined {f}" in err for f in files[:4])
    assert summary.counts["skipped"] == n - 4
    q = tmp_path / "quarantine" / files[0].parent.name
    assert sorted(p.name for p in q.glob("*.json")) == sorted(f.name for f in files[:4])
    assert len(list(q.glob("*.reason.txt"))) == 4
    after = by_id(tmp_path)
    assert after == before, differences(before, after)  # redone cells equal the originals
    assert {f: f.stat().st_mtime_ns for f in files[4:]} == mtimes  # finished cells untouched


def test_records_hold_artifact_paths_relative_to_out_so_the_folder_can_move(tmp_path):
    small_run(tmp_path / "first")
    (tmp_path / "first").rename(tmp_path / "moved")

    recs = [r for r in Store(tmp_path / "moved").records() if r.get("artifacts")]

    assert recs, "the toy reconstruction cells write a grid"
    for r in recs:
        for path in r["artifacts"].values():
            assert not Path(path).is_absolute() and ".." not in Path(path).parts and path.startswith("artifacts/")
            assert (tmp_path / "moved" / path).is_file()
    raw = [json.loads(p.read_text()) for p in (tmp_path / "moved" / "records").glob("*/*.json")]
    assert all(str(tmp_path) not in json.dumps(r.get("artifacts")) for r in raw)


def test_a_run_where_every_cell_is_na_writes_its_leaderboards(tmp_path, capsys, monkeypatch):
    from attacks.max_renyi import MaxRenyi

    monkeypatch.delenv("BENCH_THREADS", raising=False)
    summary = run([toy_task()], [FedAvg()], [MaxRenyi()], [0], tmp_path)  # the fedavg x max_renyi

    code = main(["leaderboard", "--out", str(tmp_path)])

    err = capsys.readouterr().err
    assert summary.counts["n/a"] > 0 and summary.counts["n/a"] == sum(summary.counts.values())
    assert code == 0 and "Traceback" not in err, err
    assert "n/a" in (tmp_path / "leaderboards" / "toy.md").read_text()


@pytest.mark.parametrize("damage", ["truncate", "random", "flip"])
def test_a_damaged_training_cache_is_discarded_and_retrained(tmp_path, damage):
    task, defense, _, _ = small_run(tmp_path)
    before = by_id(tmp_path)
    stem = training.cache_stem(task, defense, 0, tmp_path / "cache")
    tfile = stem.parent / json.loads(stem.with_name(stem.name + ".json").read_text())["tensors"]
    data = tfile.read_bytes()
    tfile.write_bytes(
        {
            "truncate": data[: len(data) // 3],
            "random": os.urandom(len(data)),
            "flip": data[:-8] + bytes(b ^ 0xFF for b in data[-8:]),
        }[damage]
    )
    for f in (tmp_path / "records").glob("*/*.json"):
        if json.loads(f.read_text())["defense"] == "fedavg":
            f.unlink()  # the cells that need the training run again

    _, _, summary, _ = small_run(tmp_path)

    assert summary.counts["failed"] == 0
    assert (tmp_path / "quarantine" / "cache" / "train" / tfile.name).exists()
    assert training.cached(task, defense, 0, tmp_path / "cache")  # a fresh, intact entry
    assert by_id(tmp_path) == before


def test_a_planted_pickle_in_the_training_cache_does_not_run(tmp_path):
    task, defense = toy_task(), FedAvg()
    stem = training.cache_stem(task, defense, 0, tmp_path / "cache")
    stem.parent.mkdir(parents=True)
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"global_state": Payload(marker)})
    stem.with_name(stem.name + ".pt").write_bytes(payload)  # where the former code looked (torch.load)
    # and as the current format's tensor file, with metadata whose checksum matches the planted bytes
    import hashlib

    digest = hashlib.sha256(payload).hexdigest()
    tname = f"{stem.name}-{digest[:12]}.safetensors"
    (stem.parent / tname).write_bytes(payload)
    stem.with_name(stem.name + ".json").write_text(
        json.dumps({"format": 1, "meta": {}, "tensors": tname, "sha256": digest, "nbytes": len(payload)})
    )

    _, _, summary, n = small_run(tmp_path)

    assert not marker.exists()
    assert summary.counts["failed"] == 0 and summary.counts["ok"] + summary.counts["n/a"] == n
    quarantined = {p.name for p in (tmp_path / "quarantine" / "cache" / "train").iterdir()}
    assert {stem.name + ".json", tname} <= quarantined


def test_a_legacy_torch_training_cache_is_converted_without_retraining(tmp_path, monkeypatch):
    from dataclasses import asdict

    first, moved = tmp_path / "first", tmp_path / "moved"  # a fresh folder: nothing held in memory applies
    task, defense, _, _ = small_run(first)
    before = by_id(first)
    res = training.get_training(task, defense, 0, first / "cache")
    stem = training.cache_stem(task, defense, 0, moved / "cache")
    stem.parent.mkdir(parents=True)
    torch.save(asdict(res), stem.with_name(stem.name + ".pt"))  # the former format, alone
    monkeypatch.setattr(training, "run_federated", lambda *a, **k: pytest.fail("retrained a convertible cache"))

    small_run(moved)

    assert training.cached(task, defense, 0, moved / "cache")
    assert by_id(moved) == before


@dataclass
class NaNRecon(Attack):
    """Returns NaN images: the record's SSIM is NaN, which the schema refuses."""

    name = "nan_recon"
    views = ("client_update",)
    kind = "reconstruction"

    def run(self, obs, candidates):
        return Reconstructions(torch.full((1, *obs.api.image.input_shape), float("nan")))


def test_a_record_failing_the_schema_on_write_is_kept_as_failed_with_the_reason(tmp_path):
    _, _, summary, _ = small_run(tmp_path, attacks=[NaNRecon()])

    recs = [r for r in Store(tmp_path).records() if r["view"] == "client_update"]
    assert recs and all(r["status"] == "failed" for r in recs)
    assert all("metrics." in r["reason"] and "schema" in r["reason"] for r in recs)
    assert summary.counts["failed"] == len(recs) == len(summary.failed)
    assert all("client_update" in line and "schema" in line for line in summary.failed)  # named, with the reason


def test_planted_pickles_as_ldm_base_and_vlm_projector_caches_do_not_run(tmp_path, monkeypatch):
    from models import ldm, ldm_base, vlm_align

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    marker = tmp_path / "PWNED"
    res0 = ldm_base.PretrainResult({"w": torch.ones(2)}, {"u": torch.zeros(3)}, 0.5, {"steps": 1})
    calls = []
    monkeypatch.setattr(ldm_base, "pretrain", lambda *a, **k: calls.append("ldm") or res0)
    fake_projector = lambda *a, **k: calls.append("vlm") or ({"p": torch.ones(4)}, {})  # noqa: E731
    monkeypatch.setattr(vlm_align, "pretrain_projector", fake_projector)
    cfg = ldm.LDMConfig()

    def pretrain_both():
        base, _ = ldm_base.load_or_pretrain(cfg, {"n": 1}, lambda: (None, None, None))
        proj, log, _ = vlm_align.load_or_pretrain_projector(
            {"m": 1}, lambda: None, lambda: [], None, steps=1, batch_size=1, lr=0.1, seed=0
        )
        return base, proj

    pretrain_both()  # first build: both cached
    assert calls == ["ldm", "vlm"]
    dirs = [p for p in (tmp_path / "cache").glob("*/*") if p.is_dir()]
    assert len(dirs) == 2
    for d in dirs:  # plant a payload as the legacy file and in place of the tensor file
        (d / ("base.pt" if d.parent.name == "ldm" else "projector.pt")).write_bytes(pickle.dumps(Payload(marker)))
        for t in d.glob("*.safetensors"):
            t.write_bytes(pickle.dumps(Payload(marker)))

    base, proj = pretrain_both()

    assert not marker.exists()
    assert calls == ["ldm", "vlm", "ldm", "vlm"]  # the damaged caches were discarded and rebuilt
    assert torch.equal(base.unet["u"], torch.zeros(3)) and torch.equal(proj["p"], torch.ones(4))
    for d in dirs:
        assert any(p.suffix == ".safetensors" for p in (d / "quarantine").iterdir())
    pretrain_both()  # and the rebuilt entries load
    assert len(calls) == 4


def test_a_damaged_ldm_text_state_cache_is_set_aside(tmp_path, monkeypatch):
    from models import ldm

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    marker = tmp_path / "PWNED"

    class Enc:
        def encode(self, caps):
            return torch.ones(len(caps), 2, 3)

    monkeypatch.setattr(ldm, "text_encoder", lambda cfg: Enc())
    cfg = ldm.LDMConfig(text="minilm")
    d = tmp_path / "ldm" / "text"
    d.mkdir(parents=True)
    (d / f"minilm-{cfg.text_len}.pt").write_bytes(pickle.dumps(Payload(marker)))

    states = ldm.encode_captions(cfg, ["a cat", "a dog"])

    assert not marker.exists() and set(states) == {"a cat", "a dog"}
    assert (d / "quarantine" / f"minilm-{cfg.text_len}.pt").exists()


def test_the_planted_payload_is_live(tmp_path):
    """The control for every planted-pickle test here: plain unpickling does run it."""
    pickle.loads(pickle.dumps({"global_state": Payload(tmp_path / "ran")}))

    assert (tmp_path / "ran").exists()


def plant(stem: Path, payload: bytes) -> Path:
    """Replace the tensor file of the cache entry ``stem`` with ``payload`` and make its JSON's size and
    SHA-256 match, so only the refusal to unpickle stands between the planted bytes and running them."""
    import hashlib

    head = stem.with_name(stem.name + ".json")
    meta = json.loads(head.read_text())
    (stem.parent / meta["tensors"]).unlink()
    digest = hashlib.sha256(payload).hexdigest()
    meta.update(tensors=f"{stem.name}-{digest[:12]}.safetensors", sha256=digest, nbytes=len(payload))
    (stem.parent / meta["tensors"]).write_bytes(payload)
    head.write_text(json.dumps(meta))
    return stem.parent / meta["tensors"]


def test_a_planted_pickle_in_the_reference_model_cache_does_not_run(tmp_path):
    from bench import reference as ref
    from tests.test_rmia import _population_task

    task, defense, cache = _population_task(rounds=1), FedAvg(), tmp_path / "cache"
    ref._MEMO.clear()
    first = ref.get_reference(task, defense, 0, 0, cache)
    (stem,) = [p.with_suffix("") for p in (cache / "reference").glob("*.json")]
    marker = tmp_path / "PWNED"
    planted = plant(stem, pickle.dumps({"global_state": Payload(marker)}))
    ref._MEMO.clear()  # what a later run (a fresh process) reads: the file

    again = ref.get_reference(task, defense, 0, 0, cache)

    assert not marker.exists()
    assert (tmp_path / "quarantine" / "cache" / "reference" / planted.name).exists()  # set aside, retrained
    assert all(torch.equal(first.global_state[k], again.global_state[k]) for k in first.global_state)
    assert len(list((cache / "reference").glob("*.json"))) == 1


def test_a_planted_pickle_as_the_image_pretrained_base_does_not_run(tmp_path, monkeypatch):
    from models import image

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(image, "_BASES", {})
    builds = []

    def build():
        builds.append(1)
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    def data():
        g = torch.Generator().manual_seed(1)
        return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)

    cfg, spec = image.PretrainConfig(steps=2, batch_size=4), {"test": "planted"}
    state, key = image.load_or_pretrain(build, cfg, spec, data)
    marker = tmp_path / "PWNED"
    planted = plant(tmp_path / "cache" / "image" / key / "base", pickle.dumps(Payload(marker)))
    image._BASES.clear()

    again, _ = image.load_or_pretrain(build, cfg, spec, data)

    assert not marker.exists() and len(builds) == 2  # refused, quarantined, pre-trained again
    assert (tmp_path / "cache" / "image" / key / "quarantine" / planted.name).exists()
    assert all(torch.equal(state[k], again[k]) for k in state)


def test_a_planted_pickle_as_the_hub_weights_of_the_image_models_does_not_run(tmp_path, monkeypatch):
    """The ImageNet weights come from the local HF cache through timm, which must read a ``.bin`` with
    ``weights_only=True``: a payload planted there is refused (the cell fails), never run."""
    from models import image

    marker = tmp_path / "PWNED"
    planted = tmp_path / "pytorch_model.bin"
    planted.write_bytes(pickle.dumps({"state_dict": Payload(marker)}))
    where = {"hub_id": "planted", "revision": "main", "commit": "0", "file": str(planted)}
    monkeypatch.setattr(image, "paper_weights", lambda arch: where)

    from bench.assets import AssetMissing

    with pytest.raises(AssetMissing, match="(?i)weights_only|unpickl"):  # a missing asset: exit 2 in a run
        image.resnet34(image.RESNET34, num_classes=10, img_size=224, seed=0, pretrained=True)

    assert not marker.exists()


def test_a_planted_pickle_as_a_spilled_signal_does_not_run(tmp_path):
    """The signal cache spills through bench/cachefile.py (safetensors, checksummed): a payload planted in place of
    an entry, with a matching checksum, is refused and quarantined, and the signal recomputed."""
    from bench import signal_cache

    spill = tmp_path / "cache" / "signals"
    model, items = torch.nn.Linear(2, 1), [(torch.ones(2), 0), (torch.zeros(2), 1)]
    signal_cache.SignalCache(spill).get("loss", model, items, lambda: torch.arange(2.0))
    (head,) = spill.rglob("*.json")
    marker = tmp_path / "PWNED"
    planted = plant(head.with_suffix(""), pickle.dumps(Payload(marker)))

    cache = signal_cache.SignalCache(spill)
    again = cache.get("loss", model, items, lambda: torch.arange(2.0) + 1)

    assert not marker.exists() and torch.equal(again, torch.arange(2.0) + 1) and cache.loaded == 0
    assert (tmp_path / "quarantine" / "cache" / "signals" / planted.name).exists()


# every deserialiser that can run code, and what makes each call safe
UNSAFE_LOADERS = {
    ("torch", "load"): "weights_only=True",
    ("pickle", "load"): None,
    ("pickle", "loads"): None,
    ("pickle", "Unpickler"): None,
    ("dill", "load"): None,
    ("dill", "loads"): None,
    ("cloudpickle", "load"): None,
    ("cloudpickle", "loads"): None,
    ("joblib", "load"): None,
    ("marshal", "loads"): None,
    ("shelve", "open"): None,
    ("np", "load"): "allow_pickle not True",
    ("numpy", "load"): "allow_pickle not True",
}


def _unsafe_loads(path: Path) -> list[str]:
    import ast

    found = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)):
            continue
        key = (n.func.value.id, n.func.attr)
        if key not in UNSAFE_LOADERS:
            continue
        kw = {k.arg: k.value for k in n.keywords}
        only_weights = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
        safe = (key == ("torch", "load") and only_weights) or (key[0] in ("np", "numpy") and "allow_pickle" not in kw)
        if not safe:
            found.append(f"{path.name}:{n.lineno}: {key[0]}.{key[1]}(...) in {path}")
    return found


def test_no_code_in_the_repository_deserialises_with_pickle():
    rel = lambda p: p.relative_to(ROOT).parts  # noqa: E731
    files = [p for p in ROOT.rglob("*.py") if rel(p)[0] != "tests" and not any(s.startswith(".") for s in rel(p))]
    assert len(files) > 50 and {"bench", "models", "attacks", "defenses"} <= {rel(p)[0] for p in files}

    found = [f for p in files for f in _unsafe_loads(p)]

    assert not found, "a deserialiser that can run planted code:\n" + "\n".join(found)


def test_the_deserialiser_scan_finds_what_it_looks_for(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import pickle, torch, numpy as np\n"
        "torch.load(p)\ntorch.load(p, weights_only=False)\npickle.loads(b)\nnp.load(f, allow_pickle=True)\n"
        "torch.load(p, map_location='cpu', weights_only=True)\nnp.load(f)\n"
    )

    assert [f.split(":")[1] for f in _unsafe_loads(src)] == ["2", "3", "4", "5"]


# ----------------------------------------------------------------------------------------------
# misbehaving contributed defenses through `python -m bench run` (the `check` side: tests/test_check_isolation.py)

# the run's --cell-timeout: the hanging defense costs it once; a well-behaved unit needs ~1 s, the first one also
# starts the worker (imports torch: several seconds on a loaded machine)
# the limit applies to every unit of the run, the well-behaved fedsgd ones too: 15 s failed their training once
# beside two single-thread default jobs and four test workers on 2 cores
HANG_TIMEOUT_S = 45
MISBEHAVING_RUN = {  # file stem -> (client_step body line, epsilon it reports, what its failed cells must say)
    "hangs": ("time.sleep(10**6)", "None", f"timed out after {HANG_TIMEOUT_S} s"),
    "exits": ("sys.exit(0)", "None", "SystemExit"),
    "hungry": (
        "self.hog = torch.empty(int(0.9 * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')), dtype=torch.int8)",
        "None",
        "exceeded memory cap (",
    ),
    "nan_epsilon": ("pass", "float('nan')", "reported epsilon=nan"),
    "negative_epsilon": ("pass", "-1.0", "reported epsilon=-1.0"),
}


def test_the_default_memory_cap_leaves_a_worker_room_to_start(tmp_path):
    """75% of RAM / --jobs alone falls below what a worker maps just to import torch at high --jobs (every
    cell then failed with "failed to map segment"): the default never goes below twice that, and the RAM share
    comes on top of it (at --jobs 2 on 24 GB, vlm-caption's projector alignment overran the share alone)."""
    import functools

    from bench.cli_args import address_space_mb, build_parser, worker_config
    from bench.executors import LocalExecutor, default_mem_cap_mb

    need = address_space_mb()  # measured (Linux); it grows a little as this process starts threads
    _, cfg = worker_config(build_parser().parse_args(["run", "--jobs", "256"]), "smoke", "cpu")
    _, one = worker_config(build_parser().parse_args(["run", "--jobs", "1"]), "smoke", "cpu")
    task = toy_task()
    task.source = functools.partial(toy_task)  # how a worker process rebuilds it

    summary = run([task], [FedAvg()], [ToyLossMIA()], [0], tmp_path, executor=LocalExecutor(1, cfg))

    assert need > 100 and cfg.mem_cap_mb >= max(1.9 * need, default_mem_cap_mb(256) + 0.9 * need)
    assert one.mem_cap_mb >= default_mem_cap_mb(1) + 0.9 * need  # the RAM share on top of the libraries' mappings
    assert summary.counts["failed"] == 0 and summary.counts["ok"] > 0


def test_misbehaving_contributed_defenses_fail_their_cells_with_the_reason_and_the_run_finishes(tmp_path):
    specs = []
    for stem, (line, eps, _) in MISBEHAVING_RUN.items():
        cls = "".join(w.title() for w in stem.split("_"))
        (tmp_path / f"{stem}.py").write_text(
            "import os\nimport sys\nimport time\nfrom dataclasses import dataclass\n\nimport torch\n\n"
            "from bench.registry import register_defense\nfrom defenses.fedsgd import FedSGD\n\n\n"
            f"@register_defense\n@dataclass\nclass {cls}(FedSGD):\n"
            f"    def client_step(self, state, ctx):\n        {line}\n"
            "        return super().client_step(state, ctx)\n\n"
            f"    def epsilon(self, *, delta):\n        return {eps}\n"
        )
        specs.append(str(tmp_path / f"{stem}.py"))
    out = tmp_path / "out"
    env = {**os.environ, "BENCH_QUIET": "1", "BENCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench", "run", "--preset", "smoke", "--scenario", "image-cls", "--attack", "april"]
    cmd += ["--defense", ",".join([*specs, "fedsgd"]), "--cell-timeout", str(HANG_TIMEOUT_S), "--jobs", "1"]
    cmd += ["--out", str(out)]

    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)

    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    recs = list(Store(out).records())
    for stem, (_, _, reason) in MISBEHAVING_RUN.items():
        mine = [r for r in recs if r["defense"] == stem and r["status"] != "n/a"]
        assert mine and all(r["status"] == "failed" and reason in r["reason"] for r in mine), (
            stem,
            [(r["status"], r.get("reason")) for r in mine],
        )
    fine = [r for r in recs if r["defense"] == "fedsgd" and r["status"] != "n/a"]
    assert fine and all(r["status"] == "ok" for r in fine), [r.get("reason") for r in fine]
    board = (out / "leaderboards" / "image-cls.md").read_text()
    assert all(stem in board for stem in MISBEHAVING_RUN)  # listed, failed with the reason
    said = [line for line in res.stderr.splitlines() if line.startswith("failed: ")]  # and named in the terminal
    assert all(
        any(stem in line and reason in line for line in said) for stem, (_, _, reason) in MISBEHAVING_RUN.items()
    )


# ----------------------------------------------------------------------------------------------
# kill -9 at random points, then resume


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    # a round checkpoint after every round: a kill that lands mid-training resumes from it, and must still give
    # the uninterrupted run's records
    env = {**os.environ, "BENCH_THREADS": "1", "PYTHONHASHSEED": "0", "BENCH_CHECKPOINT_S": "0"}
    with open(log, "ab") as f:  # a file, not a pipe: a full pipe would block the child's progress output
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True)


def _wait_group(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for ``proc`` and then for what it left behind in its session (e.g. worker processes finishing
    their unit after the parent died); whatever is still there after ``timeout`` is killed."""
    proc.wait(timeout=timeout)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)


def _finished_files(out: Path) -> dict[Path, tuple[int, bytes]]:
    """Records of finished cells (ok / n/a) on disk: mtime and bytes."""
    return {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in (out / "records").glob("*/*.json")
        if json.loads(p.read_bytes())["status"] in ("ok", "n/a")
    }


def kill_and_resume(cmd, out: Path, n: int, reference: dict, *, kills: int = 3, seed: int = 13) -> None:
    """Start ``cmd`` (a run into ``out``) and kill -9 it once ``k`` records are on disk (plus jitter) for
    ``kills`` random k in 1..n-1; check nothing finished is lost or redone and no file is torn; then let it
    finish and compare with ``reference`` (an uninterrupted run's records)."""
    rng = random.Random(seed)
    log = out.parent / f"{out.name}.log"
    landed = 0
    for target in sorted(rng.sample(range(1, n), kills)):
        before = _finished_files(out) if (out / "records").exists() else {}
        proc = _spawn(cmd, log)
        while proc.poll() is None and len(list((out / "records").glob("*/*.json"))) < target:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            landed += 1
        _wait_group(proc, 120)
        after = _finished_files(out)
        assert all(after.get(p) == v for p, v in before.items()), "a finished cell was redone or lost"
        assert len(list(Store(out).records())) == len(list((out / "records").glob("*/*.json"))), "a torn record"
        assert not (out / "quarantine").exists()
    assert landed >= 2, f"the kills did not land mid-run: {log.read_text()[-2000:]}"
    before = _finished_files(out)
    final = _spawn(cmd, log)
    assert final.wait(timeout=1800) == 0, log.read_text()[-2000:]
    _wait_group(final, 60)
    assert all(_finished_files(out).get(p) == v for p, v in before.items()), "a finished cell was redone"
    got = by_id(out)
    assert got == reference, differences(reference, got)[:5]  # no lost record, the same results


def uninterrupted(cmd, out: Path) -> dict:
    proc = _spawn(cmd, out.parent / f"{out.name}.log")
    assert proc.wait(timeout=1800) == 0, (out.parent / f"{out.name}.log").read_text()[-2000:]
    _wait_group(proc, 60)
    return by_id(out)


def test_kill_minus_9_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    run_into = lambda out: [sys.executable, str(ROOT / "tests" / "fault_run.py"), str(out)]  # noqa: E731
    reference = uninterrupted(run_into(tmp_path / "reference"), tmp_path / "reference")
    tasks, defenses, attacks, seeds = matrix()
    n = len(plan(tasks, defenses, attacks, seeds))
    assert len(reference) == n

    kill_and_resume(run_into(tmp_path / "killed"), tmp_path / "killed", n, reference)


@pytest.mark.slow
def test_kill_minus_9_of_bench_run_on_the_smoke_preset_then_resume(tmp_path):
    """The same through ``python -m bench run`` (its worker processes included) on a smoke slice."""
    run_into = lambda out: [
        sys.executable,
        "-m",
        "bench",
        "run",
        "--preset",
        "smoke",
        "--scenario",
        "image-cls",  # noqa: E731
        "--defense",
        "fedavg,fedsgd",
        "--attack",
        "loss_mia",
        "--out",
        str(out),
        "--no-leaderboard",
    ]
    reference = uninterrupted(run_into(tmp_path / "reference"), tmp_path / "reference")
    assert len(reference) >= 8

    kill_and_resume(run_into(tmp_path / "killed"), tmp_path / "killed", len(reference), reference, seed=7)


# ----------------------------------------------------------------------------------------------
# kill -9 of the parent of --jobs workers: the workers die with it (they would go on training)


def _session(sid: int) -> dict[int, int]:
    """Live (not zombie) processes of session ``sid``: {pid: parent pid}, read from /proc (Linux)."""
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        state, ppid, session = fields[0], int(fields[1]), int(fields[3])
        if session == sid and state not in "ZX":
            procs[int(stat.parent.name)] = ppid
    return procs


def _until(pred, timeout: float) -> float:
    """Seconds until ``pred()`` held (polling); ``timeout`` + 1 if it never did."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return time.time() - t0
        time.sleep(0.1)
    return timeout + 1


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
def test_kill_minus_9_of_a_jobs_2_run_takes_its_workers_down_then_resume_completes(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        "--preset",
        "smoke",
        "--scenario",
        "image-cls",
        "--defense",
        "fedavg,fedsgd",
        "--attack",
        "loss_mia",
        "--jobs",
        "2",
        "--out",
        str(out),
        "--no-leaderboard",
    ]
    proc = _spawn(cmd, tmp_path / "run.log")
    # workers are the forkserver's children: grandchildren of the run's process
    workers = lambda: [p for p, pp in _session(proc.pid).items() if p != proc.pid and pp not in (proc.pid, 1)]  # noqa: E731
    waited = _until(lambda: len(workers()) >= 2 or proc.poll() is not None, 600)
    seen = workers()
    assert proc.poll() is None and len(seen) == 2, (
        f"no workers after {waited:.0f} s: {(tmp_path / 'run.log').read_text()[-2000:]}"
    )

    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone_after = _until(lambda: not _session(proc.pid), 30)

    left = _session(proc.pid)
    for pid in left:  # do not leave them behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert gone_after <= 10, f"still running {gone_after:.0f} s after the parent's kill -9: {left} (workers {seen})"
    before = len(list((out / "records").glob("*/*.json"))) if (out / "records").exists() else 0
    assert before == len(list(Store(out).records())) if before else True, "a torn record after the kill"
    final = _spawn(cmd, tmp_path / "run.log")  # resume
    assert final.wait(timeout=1800) == 0, (tmp_path / "run.log").read_text()[-2000:]
    _wait_group(final, 60)
    files = list((out / "records").glob("*/*.json"))
    recs = list(Store(out).records())  # each one parsed and schema-checked
    assert len(recs) == len(files) and not (out / "quarantine").exists(), "a torn record"
    assert {r["status"] for r in recs} <= {"ok", "n/a"}, [r.get("reason") for r in recs if r["status"] == "failed"]
    assert len(recs) == _planned("image-cls", "fedavg,fedsgd", "loss_mia")


JOBS_RUN = """
import signal, sys
from tests.fault_run import hanging_jobs_run
def _terminate(signum, frame):  # as bench/__main__.py: SIGTERM stops the run like Ctrl-C
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, _terminate)
try:
    hanging_jobs_run(sys.argv[1], sys.argv[2])
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(130)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
@pytest.mark.parametrize("kill_worker", [False, True], ids=["sigterm", "sigterm-and-worker-killed"])
def test_an_interrupted_jobs_2_run_starts_no_new_unit_and_leaves_no_worker(tmp_path, kill_worker):
    """SIGTERM to a --jobs 2 run with units queued (and, at once, kill -9 of a worker): no queued unit starts,
    the run exits promptly and no process of it is left (a freed slot used to start the next unit on a new
    worker, and the shutdown then waited for that unit)."""
    marks, out, log = tmp_path / "marks", tmp_path / "out", tmp_path / "run.log"
    marks.mkdir()
    proc = _spawn([sys.executable, "-c", JOBS_RUN, str(out), str(marks)], log)
    started = lambda: sorted(p.name for p in marks.iterdir())  # noqa: E731 - "<tag>.<worker pid>" per unit
    records = lambda: sorted(out.glob("records/*/*.json"))  # noqa: E731
    _until(lambda: len(started()) >= 2 or proc.poll() is not None, 120)
    first, written = started(), records()
    assert proc.poll() is None and len(first) == 2, log.read_text()[-2000:]

    os.kill(proc.pid, signal.SIGTERM)
    if kill_worker:
        with contextlib.suppress(ProcessLookupError):  # the run may have killed it already
            os.kill(int(first[0].split(".")[1]), signal.SIGKILL)
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        code = None
    gone_after = _until(lambda: not _session(proc.pid), 10)

    left = _session(proc.pid)
    for pid in left:  # do not leave them behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert started() == first and records() == written, f"a unit started after the interrupt: {started()}"
    assert code == 130 and "interrupted" in log.read_text(), f"exit {code}: {log.read_text()[-2000:]}"
    assert gone_after <= 5, f"still running {gone_after:.0f} s after the run exited: {left}"


def _planned(scenario: str, defenses: str, attacks: str) -> int:
    """Cells a one-seed smoke ``bench run`` of these names plans."""
    from bench.cli import build_tasks
    from bench.registry import ATTACKS as A
    from bench.registry import DEFENSES as D
    from bench.registry import expand

    return len(plan(build_tasks([scenario], "smoke"), expand(D, defenses, full_grid=False), expand(A, attacks), [0]))


def test_a_diverging_training_says_where_it_diverged():
    task = toy_task(lr=1e30)  # SGD at this step size overflows within the first steps

    with pytest.raises(TrainingDiverged, match=r"training diverged: client \d, round 1 of 2, local step \d+"):
        run_federated(task, FedAvg(), 0)
