"""End-to-end smoke runs of the real CLI on the image-classification slice (APRIL controls, paired rows)."""

from __future__ import annotations

import csv
import json

from tests.test_cli import bench


def test_cli_smoke_run_writes_records_and_leaderboards_and_resumes(tmp_path):
    out = tmp_path / "out"
    args = (
        "run",
        "--scenario",
        "image-cls",
        "--preset",
        "smoke",
        "--defense",
        "fedsgd,fixed_position,flrsp:R=0.8:form=fedsgd",
        "--attack",
        "april",
        "--out",
        str(out),
    )

    first = bench(*args, cwd=tmp_path)

    assert first.returncode == 0, first.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    ssim = {
        r["defense_label"]: r["metrics"]["ssim"]["value"]
        for r in recs
        if r["task"] == "image-cls/vit" and r["status"] == "ok"
    }
    assert ssim["fedsgd"] >= 0.9  # positive control: undefended ViT, batch 1
    assert ssim["fixed_position"] < 0.3  # negative control: no positional-embedding update
    assert ssim["flrsp(R=0.8,form=fedsgd)"] < ssim["fedsgd"]
    resnet = [r for r in recs if r["task"] == "image-cls/resnet34"]
    assert resnet and all(r["status"] == "n/a" for r in resnet)
    for name in ("image-cls.csv", "image-cls.md", "image-cls_cells.csv"):
        assert (out / "leaderboards" / name).is_file(), name
    with open(out / "leaderboards" / "image-cls_cells.csv") as f:
        assert len(list(csv.DictReader(f))) == len(recs)
    assert list(out.glob("artifacts/*/grid.png"))

    again = bench(*args, cwd=tmp_path)

    assert again.returncode == 0
    assert f"0 ok, 0 n/a, 0 failed, {len(recs)} already done" in again.stdout


def test_cli_smoke_reconstruction_rows_share_target_ids_and_compare_paired(tmp_path):
    out = tmp_path / "out"
    defenses = "fedavg,fixed_position,flrsp:R=0.8"
    args = ("run", "--scenario", "image-cls", "--preset", "smoke", "--defense", defenses, "--attack", "april")

    done = bench(*args, "--out", str(out), cwd=tmp_path)

    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    ids = {r["defense_label"]: r["per_candidate"]["id"] for r in recs if r["status"] == "ok"}
    assert set(ids) == {"fedavg", "fixed_position", "flrsp(R=0.8)"}
    assert ids["fedavg"] and all(v == ids["fedavg"] for v in ids.values())  # the same targets, by id
    with open(out / "leaderboards" / "image-cls.csv") as f:
        rows = {r["defense"]: r for r in csv.DictReader(f) if r["task"] == "image-cls/vit"}
    for d in ("fixed_position", "flrsp(R=0.8)"):
        assert rows[d]["april/client_update:ssim.vs_baseline.method"] == "paired", d
    lines = (out / "leaderboards" / "claims.md").read_text().splitlines()
    claim = next(line for line in lines if line.startswith("| papers/003 FLRSP") and "| smoke " in line)
    assert "april/client_update" in claim and "(paired)" in claim and "(unpaired)" not in claim
