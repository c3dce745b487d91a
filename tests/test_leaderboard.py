"""Leaderboards from records: statistics over seeds and samples, significance, determinism, the
cross-matrix, plots, reported-vs-measured and the claims (synthetic records: no training needed)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score, roc_curve

from bench.metrics import mean_ci, membership_metrics, tpr_at_fpr
from bench.report import claims, reported
from bench.report.leaderboards import write_leaderboards
from bench.report.plots import epsilon_series
from bench.report.results import Results
from bench.report.stats import auroc_rows, membership_estimate, tpr_at_fpr_rows
from bench.report.tables import matrix_table, scenario_table
from bench.store import Store


def member_scores(strength: float, n: int, seed: int) -> tuple[list[float], list[int]]:
    """n members shifted by ``strength`` against n non-members (AUROC grows with strength)."""
    rng = np.random.default_rng(seed)
    s = np.concatenate([rng.normal(strength, 1, n), rng.normal(0, 1, n)])
    return s.tolist(), [1] * n + [0] * n


def rec(
    *,
    scenario="sc",
    task="sc/a",
    preset="smoke",
    defense="fedavg",
    params=None,
    label=None,
    attack="mia",
    attack_label=None,
    kind="membership",
    view="global_model",
    seed=0,
    status="ok",
    reason="",
    strength=1.0,
    n=64,
    per_candidate=True,
    ssim=None,
    utility=None,
    privacy=None,
    cost=None,
    variants=None,
    ids=True,
    score_seed=None,
    targets=None,
):
    r = {
        "cell_id": re.sub(r"[^A-Za-z0-9_.-]", "_", f"{task}-{label or defense}-{attack_label or attack}-{view}-{seed}"),
        "scenario": scenario,
        "task": task,
        "preset": preset,
        "defense": defense,
        "defense_params": params or {},
        "defense_label": label or defense,
        "attack": attack,
        "attack_params": {},
        "attack_label": attack_label or attack,
        "attack_kind": kind,
        "view": view,
        "seed": seed,
        "status": status,
        "reason": reason,
        "utility": utility if utility is not None else ({} if defense == "base" else {"accuracy": 0.8}),
        "privacy": privacy or {"epsilon": None, "epsilon_composed": None, "delta": None, "note": ""},
        "cost": cost
        or {
            "bytes_up_per_round": 1000.0,
            "bytes_down_per_round": 2000.0,
            "rounds": 2,
            "train_wall_s": 1.0,
            "attack_wall_s": 0.5,
        },
        "provenance": {"code_version": "test", "config_hash": "cfg", "started_at": "2026-01-01T00:00:00Z"},
    }
    if status != "ok":
        return r
    if kind == "membership":
        s, y = member_scores(strength, n, seed if score_seed is None else score_seed)
        metrics, roc = membership_metrics(s, y, n_boot=50, seed=seed)
        r.update(metrics=metrics, roc=roc, primary="score", variants=variants or {}, n_candidates=len(y))
        if per_candidate:
            r["per_candidate"] = {"score": s, "member": y}
            if ids:  # the same candidates for every row of a seed: m:<i> / n:<i> into the member / non-member pools
                r["per_candidate"]["id"] = [f"m:{i}" for i in range(n)] + [f"n:{i}" for i in range(n)]
    else:
        r.update(
            per_sample={"ssim": list(ssim), "psnr": [10 + 10 * v for v in ssim]},
            metrics={"ssim": mean_ci(ssim, seed=seed), "psnr": mean_ci([10 + 10 * v for v in ssim], seed=seed)},
        )
        if targets is not None:  # target ids, as bench.recon_cells.per_target keeps them (older records have none)
            r.update(primary="ssim", per_candidate={"id": list(targets), "score": list(ssim), "variants": {}})
            r["per_candidate"]["variants"]["psnr"] = r["per_sample"]["psnr"]
    return r


def write(tmp_path, recs):
    st = Store(tmp_path)
    for r in recs:
        st.write(r)
    return Results.load(tmp_path)


# ----------------------------------------------------------------------------------------------
# statistics


def test_vectorised_auroc_and_tpr_match_sklearn_and_bench_metrics():
    rng = np.random.default_rng(0)
    s = np.round(rng.normal(size=200), 1)  # ties on purpose
    y = np.array([1] * 90 + [0] * 110)

    auc = auroc_rows(s[y == 1][None], s[y == 0][None])[0]
    fpr, tpr, _ = roc_curve(y, s)

    assert auc == pytest.approx(roc_auc_score(y, s))
    for f in (0.01, 0.05, 0.2):
        assert tpr_at_fpr_rows(s[y == 1][None], s[y == 0][None], f)[0] == pytest.approx(tpr_at_fpr(fpr, tpr, f))


def test_single_seed_estimate_reproduces_the_record_point_value():
    r = rec(strength=1.0, n=200)  # 200 non-members: TPR at 5% FPR is reported

    for metric in ("auroc", "tpr@0.05fpr"):
        e = membership_estimate([r], metric, key="k")
        assert e.value == pytest.approx(r["metrics"][metric]["value"])
        assert e.lo <= e.value <= e.hi


def test_seeds_are_pooled_hierarchically_and_narrow_the_interval():
    one = [rec(seed=0, n=32)]
    four = [rec(seed=s, n=32) for s in range(4)]

    e1 = membership_estimate(one, "auroc", key="a")
    e4 = membership_estimate(four, "auroc", key="b")

    assert e4.n_seeds == 4 and "seeds" in e4.method
    assert e4.value == pytest.approx(np.mean([r["metrics"]["auroc"]["value"] for r in four]))
    assert (e4.hi - e4.lo) < (e1.hi - e1.lo)


def test_without_per_candidate_scores_record_intervals_are_combined():
    recs = [rec(seed=s, per_candidate=False) for s in range(3)]

    e = membership_estimate(recs, "auroc", key="c")

    assert e.method.startswith("normal") and e.n_seeds == 3
    assert e.lo < e.value < e.hi
    single = membership_estimate(recs[:1], "auroc", key="c")
    assert (single.lo, single.hi) == (recs[0]["metrics"]["auroc"]["ci_low"], recs[0]["metrics"]["auroc"]["ci_high"])


def test_table_marks_best_group_and_comparison_with_the_baseline(tmp_path):
    res = write(
        tmp_path,
        [
            rec(defense="fedavg", strength=2.5),
            rec(defense="flrsp", label="flrsp(R=0.8)", strength=0.0),
            rec(defense="dp", label="dp(eps=1)", strength=0.1),
            rec(defense="base", strength=0.0),
        ],
    )

    table, meta = scenario_table(res, "sc")

    t = table.set_index("defense")
    col = "mia/global_model:auroc"
    assert t.loc["flrsp(R=0.8)", f"{col}.best"] == 1 and t.loc["dp(eps=1)", f"{col}.best"] == 1
    assert t.loc["fedavg", f"{col}.best"] == 0
    assert math.isnan(t.loc["base", f"{col}.best"])  # the shift check is not ranked
    assert t.loc["flrsp(R=0.8)", f"{col}.vs_baseline"] == "less leakage"
    assert list(table.defense) == ["base", "fedavg", "dp(eps=1)", "flrsp(R=0.8)"]
    assert {m["column"] for m in meta} == {
        col,
        "mia/global_model:tpr@0.05fpr",
        "mia/global_model:tpr@0.01fpr",
        "mia/global_model:tpr@0.001fpr",
    }
    # 64 non-members resolve no TPR at 5% FPR or below: n/a with the reason, no number
    assert "needs >= 200 non-members" in t.loc["fedavg", "mia/global_model:tpr@0.05fpr.status"]
    # the headline: the change from the base model on the same candidates (paired: the rows share ids)
    assert t.loc["fedavg", f"{col}.vs_base"] > 0.3 and t.loc["fedavg", f"{col}.vs_base.ci_low"] > 0.2
    assert t.loc["fedavg", f"{col}.vs_base.method"].startswith("paired")


def test_a_within_run_spread_is_not_a_utility_column(tmp_path):
    # KID's spread over one whole-set subset, and the number of images FID / KID were computed on
    utility = {"kid_effnetlite0": 0.1, "kid_effnetlite0_std": 2.8e-16, "n_generated": 96.0}
    res = write(tmp_path, [rec(defense="fedavg", strength=2.5, seed=s, utility=utility) for s in range(2)])

    table, _ = scenario_table(res, "sc")

    assert "utility.kid_effnetlite0" in table.columns
    assert not [c for c in table.columns if c.startswith(("utility.kid_effnetlite0_std", "utility.n_generated"))]


def test_a_diverged_training_run_is_shown_in_its_row_not_left_blank(tmp_path):
    # arrange: dp_gaussian diverged in every seed, dp_fedlora in seed 2 only (seeds 0-1 have results)
    from bench.report.markdown import display

    why = "training failed: TrainingDiverged: training diverged: round 3 of 9: non-finite global w"
    failed = dict(status="failed", reason=why)
    recs = [rec(defense="fedavg", strength=2.5, seed=s) for s in range(3)]
    recs += [rec(defense="dp_gaussian", seed=s, utility={}, **failed) for s in range(3)]
    recs += [rec(defense="dp_fedlora", strength=0.5, seed=s) for s in range(2)]
    recs += [rec(defense="dp_fedlora", seed=2, utility={}, **failed)]
    res = write(tmp_path, recs)

    # act
    header, rows = display(*scenario_table(res, "sc"))

    # assert
    by = {row[1].text.split(" (")[0]: row for row in rows}
    accuracy, cell = header.index("accuracy"), header.index("mia/global AUROC")
    assert by["dp_gaussian"][accuracy].text == "diverged" and by["dp_gaussian"][cell].text == "diverged"
    assert by["dp_fedlora"][1].text == "dp_fedlora (diverged: seed 2)" and by["dp_fedlora"][accuracy].text != ""
    assert by["fedavg"][1].text == "fedavg"


def test_the_not_reported_note_names_the_columns_when_another_attack_reports_the_metric():
    # arrange: loss reports TPR at 5% FPR in the global view; a failed ref_loss cell has no value at any FPR
    import pandas as pd

    from bench.report.markdown import hidden_columns

    def m(attack, metric):
        return {
            "column": f"{attack}/global_model:{metric}",
            "attack": attack,
            "view": "global_model",
            "metric": metric,
            "primary": False,
        }

    meta = [m(a, f) for a in ("loss_mia", "ref_loss") for f in ("tpr@0.05fpr", "tpr@0.01fpr")]
    table = pd.DataFrame({"loss_mia/global_model:tpr@0.05fpr": [0.3], "ref_loss/global_model:tpr@0.05fpr": [None]})

    # act
    note = hidden_columns(table, meta)

    # assert: TPR@1% is missing everywhere; TPR@5% only from ref_loss's column
    assert note == "TPR@1%FPR; TPR@5%FPR of ref_loss/global"
    assert hidden_columns(table.fillna(0.1), meta[:1]) == ""


def test_reconstruction_metrics_pool_images_over_seeds(tmp_path):
    res = write(
        tmp_path,
        [
            rec(
                kind="reconstruction",
                attack="ig",
                view="client_update",
                seed=s,
                ssim=[0.1 + 0.1 * s, 0.2 + 0.1 * s, 0.3 + 0.1 * s],
            )
            for s in range(2)
        ],
    )

    e = res.metric(res.records, "ssim")

    assert e.value == pytest.approx(np.mean([0.1, 0.2, 0.3, 0.2, 0.3, 0.4]))
    assert e.lo < e.value < e.hi and e.n_seeds == 2


def test_matrix_has_one_cell_per_pair_with_na_and_failed_reasons(tmp_path):
    res = write(
        tmp_path,
        [
            rec(defense="fedavg"),
            rec(
                defense="fixed",
                attack="april",
                status="n/a",
                reason="needs a ViT with a learnable positional embedding",
            ),
            rec(defense="boom", status="failed", reason="RuntimeError: client exploded"),
            rec(defense="fedavg", attack="april", kind="reconstruction", view="client_update", ssim=[0.9, 0.8]),
        ],
    )

    m = matrix_table(res, "sc").set_index("defense")

    assert m.loc["fixed", "april"] == "n/a: needs a ViT with a learnable positional embedding"
    assert m.loc["boom", "mia"] == "failed: RuntimeError: client exploded"
    assert m.loc["fedavg", "april"].startswith("update ssim 0.850")


def test_leaderboard_is_byte_identical_from_the_same_records(tmp_path):
    recs = [
        rec(defense=d, label=d, seed=s, strength=st, view=v)
        for d, st in (("fedavg", 1.5), ("flrsp", 0.3))
        for s in range(2)
        for v in ("global_model", "client_model")
    ]
    recs += [rec(defense="base", strength=0.0), rec(defense="boom", status="failed", reason="x")]
    write(tmp_path / "run", recs)

    a = write_leaderboards(tmp_path / "run", tmp_path / "a")
    b = write_leaderboards(tmp_path / "run", tmp_path / "b")

    names = sorted(p.name for p in a if p.suffix in (".csv", ".md", ".html"))
    assert names == sorted(p.name for p in b if p.suffix in (".csv", ".md", ".html"))
    assert {
        "sc.csv",
        "sc_matrix.csv",
        "sc_cells.csv",
        "sc.md",
        "index.html",
        "claims.csv",
        "reported_vs_measured.csv",
    } <= set(names)
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    md = (tmp_path / "a" / "sc.md").read_text()
    assert "Cross-matrix" in md and "Distribution-shift check" in md and "client exploded" not in md.split("Failed")[0]


def test_a_one_seed_utility_is_shown_in_the_format_of_an_interval_row(tmp_path):
    recs = [rec(defense="fedavg", seed=s, utility={"fid_x": 131.5 + s}) for s in range(2)]
    recs.append(rec(defense="flrsp", utility={"fid_x": 133.1}))  # one seed: no interval
    write(tmp_path / "run", recs)

    write_leaderboards(tmp_path / "run", tmp_path / "lb")

    row = next(line for line in (tmp_path / "lb" / "sc.md").read_text().splitlines() if "| flrsp " in line)
    assert "| 133.100 " in row  # not "133.1" beside fedavg's "132.000 [...]"


def test_the_cells_table_shows_what_an_attack_said_about_its_run(tmp_path):
    from bench.report.tables import cells_table

    # arrange
    noted = rec(defense="fedavg", seed=0)
    noted["attack_notes"] = ["client optimiser adam: the update is ~lr x sign(g)", "second"]
    res = write(tmp_path, [noted, rec(defense="fedavg", seed=1)])

    # act
    df = cells_table(res, "sc")

    # assert
    assert df.attack_notes.tolist() == ["client optimiser adam: the update is ~lr x sign(g); second", ""]


def test_a_defense_keeps_its_colour_in_every_tradeoff_panel(tmp_path, monkeypatch):
    from bench.report import charts

    figs = []
    monkeypatch.setattr(charts, "save_figure", lambda fig, path: figs.append(fig) or str(path))
    pt = {"x": 1.0, "y": 0.6, "xlo": 0.9, "xhi": 1.1, "ylo": 0.5, "yhi": 0.7}
    panels = [
        {"points": [dict(pt, label=d) for d in ds], "title": t, "ref": 0.5, "xlabel": "u", "ylabel": "AUROC"}
        for t, ds in (("a", ["lora", "mp_lora"]), ("b", ["smp_lora", "lora"]))
    ]

    charts.save_tradeoff(panels, tmp_path / "t.png", title="t")

    colours = [{c.get_label(): c.lines[0].get_color() for c in ax.containers} for ax in figs[0].axes[:2]]
    assert colours[0]["lora"] == colours[1]["lora"] and len({*colours[0].values(), *colours[1].values()}) == 3


def test_plots_cover_roc_tradeoff_ssim_communication_and_epsilon(tmp_path):
    from defenses.dp_gaussian import DPGaussian

    d = DPGaussian(eps=2.0)
    comp = d.epsilon_composed(delta=1e-5, rounds=6, sample_rate=0.5)
    dp_priv = {"epsilon": 2.0, "epsilon_composed": comp, "delta": 1e-5, "note": "", "sample_rate": 0.5}
    dp_cost = {"bytes_up_per_round": 900.0, "bytes_down_per_round": 2000.0, "rounds": 6}
    recs = [
        rec(defense="fedavg"),
        rec(
            defense="dp_gaussian",
            params={"eps": 2.0, "clip": 1.0, "delta": None, "form": "fedavg"},
            label="dp_gaussian(eps=2.0)",
            privacy=dp_priv,
            cost=dp_cost,
            strength=0.2,
        ),
        rec(defense="fedavg", attack="ig", kind="reconstruction", view="client_update", ssim=[0.9, 0.7]),
        rec(
            defense="dp_gaussian",
            label="dp_gaussian(eps=2.0)",
            params={"eps": 2.0},
            attack="ig",
            kind="reconstruction",
            view="client_update",
            ssim=[0.2, 0.1],
            privacy=dp_priv,
            cost=dp_cost,
        ),
    ]
    write(tmp_path, recs)

    files = [p.name for p in write_leaderboards(tmp_path) if p.suffix == ".png"]

    for prefix in ("roc_", "tradeoff_", "ssim_", "communication_", "epsilon_"):
        assert any(f.startswith(prefix) for f in files), (prefix, files)
    xs, ys, note = epsilon_series(recs[1])
    assert xs[0] == 1 and xs[-1] == 6 and ys[-1] == pytest.approx(comp, rel=1e-3) and "sample rate 0.5" in note
    assert all(a < b for a, b in zip(ys, ys[1:]))  # composition only grows
    no_rate = {**recs[1], "privacy": {**dp_priv, "sample_rate": None}}
    assert epsilon_series(no_rate)[:2] == ([6], [comp])


# ----------------------------------------------------------------------------------------------
# reported vs measured, claims


def test_reported_numbers_are_transcribed_for_every_paper():
    rep = reported.load()

    assert {"papers/000", "papers/002", "papers/003", "papers/004"} <= set(rep.paper)
    tables = set(zip(rep.paper, rep.table))
    for t in (
        ("papers/000", "Table 4"),
        ("papers/000", "Table 1 (server)"),
        ("papers/002", "Table I"),
        ("papers/002", "Table II"),
        ("papers/004", "Table 1"),
        ("papers/004", "Table 11"),
    ):
        assert t in tables
    row = rep[
        (rep.table == "Table 4")
        & rep.setting.str.endswith("FedRand (client)")
        & (rep.metric == "AUROC MaxRenyi-0% (image)")
    ]
    assert row.value.tolist() == ["47.83"] and row.spread.tolist() == ["3.56"]
    assert len(rep[(rep.paper == "papers/000") & (rep.table == "Table 4")]) == 28
    assert len(rep[(rep.paper == "papers/002") & (rep.table == "Table II")]) == 42


def test_reported_is_shown_beside_the_closest_measurement_never_mixed(tmp_path):
    var = lambda a: {"maxrenyi_K0_a0.5_text": {"auroc": a}}  # noqa: E731
    res = write(
        tmp_path,
        [
            rec(scenario="llm-text", task="llm-text", defense="fedavg", attack="max_renyi", variants=var(0.71), view=v)
            for v in ("global_model", "client_model")
        ],
    )

    out = reported.compare(res)

    row = out[
        (out.table == "Table 4")
        & out.setting.str.endswith("FedAvg (server)")
        & (out.metric == "AUROC MaxRenyi-0% (caption)")
        & (out.scenario == "llm-text")
    ]
    assert row.reported.tolist() == ["70.22 +- 2.56 percent"]
    assert row["reported (suite scale)"].tolist() == ["0.7022"]
    assert row.measured_value.tolist() == [pytest.approx(0.71)]  # the suite's own number, from the record
    assert row.view.tolist() == ["global_model"]
    image = out[(out.table == "Table 4") & (out.metric == "AUROC MaxRenyi-0% (image)") & (out.scenario == "llm-text")]
    assert set(image.measured) == {"not measured"}  # a text-only scenario has no image slice


def _fedrand_records(fedrand_strength, fedrand_loss, *, base_strength=0.0, fedrand_score_seed=None, attack="max_renyi"):
    out = [
        rec(scenario="llm-text", task="llm-text", defense="base", attack=attack, strength=base_strength, seed=s)
        for s in range(2)
    ]
    for d, st, loss in (("fedavg", 2.0, 3.0), ("fedrand", fedrand_strength, fedrand_loss)):
        for s in range(2):
            out.append(
                rec(
                    scenario="llm-text",
                    task="llm-text",
                    defense=d,
                    attack=attack,
                    view="client_model",
                    strength=st,
                    seed=s,
                    utility={"test_loss": loss + 0.01 * s, "perplexity": math.exp(loss)},
                    score_seed=None if d == "fedavg" or fedrand_score_seed is None else fedrand_score_seed + s,
                )
            )
    return out


@pytest.mark.parametrize(
    "kw, verdict",
    [
        (dict(fedrand_strength=0.0, fedrand_loss=3.05), "holds"),
        # the same scores as FedAvg: a powered comparison (MDE 0) that excludes the claimed effect
        (dict(fedrand_strength=2.0, fedrand_loss=3.0), "contradicted"),
        (dict(fedrand_strength=0.0, fedrand_loss=4.0), "contradicted"),  # less leakage, but utility 33% worse
        # other draws of equal leakage on 64+64 candidates: the MDE is far above the claimed 0.02
        (dict(fedrand_strength=2.0, fedrand_loss=3.0, fedrand_score_seed=100), "inconclusive"),
        # the base model leaks as much as FedAvg: the positive control fails
        (dict(fedrand_strength=0.0, fedrand_loss=3.05, base_strength=2.0), "inconclusive"),
    ],
)
def test_fedrand_claim_verdict_follows_the_intervals_utility_power_and_control(tmp_path, kw, verdict):
    res = write(tmp_path, _fedrand_records(**kw))

    rows = [c for c in _paper_rows(res) if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text"]

    assert [c["verdict"] for c in rows] == [verdict], rows[0]["evidence"]
    assert rows[0]["preset"] == "smoke" and rows[0]["effect"] == f"{claims.FEDRAND_EFFECT:.3g}" and rows[0]["mde"]
    vlm = [c for c in claims.evaluate(res) if c["paper"].startswith("papers/000") and c["scenario"] == "vlm-caption"]
    assert vlm[0]["verdict"] == "not measured"


def _fedavg_at_chance_in_the_global_view():
    return [
        rec(scenario="llm-text", task="llm-text", defense="fedavg", attack="max_renyi", strength=0.0, seed=s)
        for s in range(2)
    ]


@pytest.mark.parametrize(
    "kw, verdict",
    [
        (dict(fedrand_strength=0.0, fedrand_loss=3.05), "holds"),  # the client view's own control passes
        (dict(fedrand_strength=0.0, fedrand_loss=4.0), "contradicted"),  # the utility clause is never gated
    ],
)
def test_a_control_failing_in_another_view_does_not_gate_a_claim_on_this_one(tmp_path, kw, verdict):
    # arrange: FedAvg at chance in the global view (that view's control fails), leaking in the client view
    res = write(tmp_path, _fedrand_records(**kw) + _fedavg_at_chance_in_the_global_view())

    # act
    row = next(c for c in _paper_rows(res) if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text")

    # assert
    assert res.control_text("smoke", "llm-text").startswith("failed: global_model")
    assert row["verdict"] == verdict, row["evidence"]


def test_a_failed_control_in_the_claims_view_leaves_its_leakage_clause_inconclusive_but_not_its_utility(tmp_path):
    # arrange: the base model leaks as much as FedAvg (the client view's control fails); FedRand's utility is 33% worse
    res = write(tmp_path, _fedrand_records(fedrand_strength=0.0, fedrand_loss=4.0, base_strength=2.0))

    # act
    row = next(c for c in _paper_rows(res) if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text")

    # assert: the leakage clause says why it is undecided; the utility loss still contradicts the claim
    assert "positive control in client_model FAILED" in row["evidence"] and "-> inconclusive" in row["evidence"]
    assert row["verdict"] == "contradicted" and "worse" in row["evidence"]


@pytest.mark.parametrize(
    "losses, verdict, word",
    [
        ((3.05, None), "inconclusive", "undecided (1 seed(s) shared"),  # one seed: no interval, nothing decided
        ((3.03, 3.2), "inconclusive", "undecided (loss"),  # the interval straddles the 5% tolerance
        ((3.03, 3.04), "holds", "comparable (loss"),
        ((3.5, 3.5), "contradicted", "worse (loss"),
    ],
)
def test_a_utility_clause_is_decided_on_a_seed_paired_interval(tmp_path, losses, verdict, word):
    # arrange: FedRand leaks less than FedAvg (the leakage clause holds); its test loss per seed as given
    recs = [r for r in _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.0) if r["defense"] != "fedrand"]
    for s, loss in enumerate(losses):
        if loss is not None:
            recs.append(
                rec(
                    scenario="llm-text",
                    task="llm-text",
                    defense="fedrand",
                    attack="max_renyi",
                    view="client_model",
                    strength=0.0,
                    seed=s,
                    utility={"test_loss": loss + 0.01 * s, "perplexity": math.exp(loss)},
                )
            )
    res = write(tmp_path, recs)

    # act
    row = next(c for c in _paper_rows(res) if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text")

    # assert
    assert row["verdict"] == verdict and word in row["evidence"], row["evidence"]


def test_a_utility_clause_takes_every_seeds_training_run_not_only_the_seeds_its_attack_ran(tmp_path):
    # arrange: MaxRenyi cells at seeds 0 and 1 (FedRand's test loss 1.7% worse at both), RMIA cells at seed 0 only
    recs = _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05)
    recs += [r for r in _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05, attack="rmia") if r["seed"] == 0]
    res = write(tmp_path, recs)

    # act
    rows = [c for c in claims.evaluate(res) if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text"]

    # assert: both rows decide utility on the same two training runs per defense
    strongest = next(c for c in rows if c["attacks"].startswith("strongest"))
    assert "comparable (loss" in strongest["evidence"] and "over 2 paired seeds" in strongest["evidence"]
    assert strongest["verdict"] == "holds", strongest["evidence"]


def test_a_seed_the_claims_cell_ran_keeps_the_training_run_that_cell_scored(tmp_path):
    # arrange: at seed 0 the RMIA cell scored a later FedRand run (test loss 3.25) than the MaxRenyi cell (3.05)
    recs = _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05)
    later = _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.25, attack="rmia")
    recs += [r for r in later if r["seed"] == 0]

    # act
    rows = [c for c in claims.evaluate(write(tmp_path, recs)) if c["paper"].startswith("papers/000")]

    # assert: the strongest row's utility is seed 0's RMIA run and seed 1's only run: mean (3.25 + 3.06) / 2
    strongest = next(c for c in rows if c["scenario"] == "llm-text" and c["attacks"].startswith("strongest"))
    assert "test_loss 3.15 vs fedavg 3" in strongest["evidence"], strongest["evidence"]
    assert "(loss +0.050 [" in strongest["evidence"]  # the loss too: seed 0's (3.25 - 3) / 3 and seed 1's 0.05 / 3.01


def test_a_claim_row_says_whether_its_scenario_is_the_papers_setting_or_an_extension(tmp_path):
    # arrange: FedRand's paper evaluated VLMs only; the suite also checks the claim on text LLMs
    res = write(tmp_path, _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05))

    # act
    rows = {c["scenario"]: c for c in _paper_rows(res) if c["paper"].startswith("papers/000")}

    # assert
    assert rows["vlm-caption"]["setting"] == claims.PAPERS_OWN
    assert rows["llm-text"]["setting"].startswith("extension (the paper evaluated vision-language models")
    assert "| setting" in claims.markdown(list(rows.values())).replace("  ", " ")
    with pytest.raises(ValueError, match="not among its scenarios"):
        claims.claim("papers/x", ("llm-text",), "t", attacks=None, evaluated="e", own=("vlm-caption",))


def _paper_rows(res):
    """The claims checked with each paper's own attacks (the ``strongest:`` re-checks left out)."""
    return [c for c in claims.evaluate(res) if c["attacks"].startswith("paper")]


def _fedrand_rows(res, scenario: str) -> dict[str, dict]:
    """FedRand's claim rows of ``scenario``, by their ``attacks`` (paper / strongest / base-calibrated)."""
    return {
        c["attacks"]: c
        for c in claims.evaluate(res)
        if c["paper"].startswith("papers/000") and c["scenario"] == scenario
    }


def _leaky_recheck(tmp_path, attack: str):
    """FedRand's claim holds under MaxRenyi; ``attack`` separates FedRand's members as well as FedAvg's."""
    recs = _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05)
    recs += _fedrand_records(fedrand_strength=2.0, fedrand_loss=3.05, attack=attack)
    return write(tmp_path, recs)


def test_a_membership_claim_is_rechecked_with_the_strongest_attack_side_by_side(tmp_path):
    # arrange
    res = _leaky_recheck(tmp_path, "rmia")

    rows = _fedrand_rows(res, "llm-text")

    assert set(rows) == {"paper: max_renyi", "strongest: rmia", "base-calibrated: ref_loss"}
    assert rows["base-calibrated: ref_loss"]["verdict"] == "not measured"  # no ref_loss records here
    assert rows["paper: max_renyi"]["verdict"] == "holds" and "rmia" not in rows["paper: max_renyi"]["evidence"]
    assert rows["strongest: rmia"]["verdict"] == "contradicted", rows["strongest: rmia"]["evidence"]
    assert "max_renyi" not in rows["strongest: rmia"]["evidence"]
    # without reference-model records the re-check says so
    flrsp = [c for c in claims.evaluate(res) if c["paper"].startswith("papers/003")]
    assert [c["attacks"] for c in flrsp] == ["paper"] * len(flrsp)
    assert {a: c["verdict"] for a, c in _fedrand_rows(res, "vlm-caption").items()} == {
        "paper: max_renyi": "not measured",
        "strongest: rmia": "not measured",
        "base-calibrated: ref_loss": "not measured",
    }


def test_a_membership_claim_is_also_rechecked_with_the_base_calibrated_loss(tmp_path):
    # arrange
    res = _leaky_recheck(tmp_path, "ref_loss")

    # act
    rows = _fedrand_rows(res, "llm-text")

    # assert
    assert rows["paper: max_renyi"]["verdict"] == "holds" and rows["strongest: rmia"]["verdict"] == "not measured"
    row = rows["base-calibrated: ref_loss"]
    assert row["verdict"] == "contradicted" and "ref_loss" in row["evidence"] and "max_renyi" not in row["evidence"]


def test_the_strongest_recheck_uses_the_attacks_default_configuration_only(tmp_path):
    # arrange: default RMIA separates FedRand's members as well as FedAvg's; an rmia(a=0.3) cell would say it holds
    recs = _fedrand_records(fedrand_strength=2.0, fedrand_loss=3.05, attack="rmia")
    fixed = _fedrand_records(fedrand_strength=0.0, fedrand_loss=3.05, attack="rmia")
    for r in fixed:
        r["attack_label"] = "rmia(a=0.3)"
        r["cell_id"] += "-a03"
    res = write(tmp_path, recs + fixed)

    row = next(
        c
        for c in claims.evaluate(res)
        if c["paper"].startswith("papers/000") and c["scenario"] == "llm-text" and c["attacks"] == "strongest: rmia"
    )

    assert row["verdict"] == "contradicted" and "rmia(a=0.3)" not in row["evidence"], row["evidence"]
    assert any(r["attack_label"] == "rmia(a=0.3)" for r in res.records)  # still in the leaderboards


def _claim_records(*, composed=5.0, ref_accuracy=0.6, num_classes=None, recon_attack="april", ldm_base=0.0):
    recs = [
        rec(
            scenario=sc,
            task=sc,
            defense="base",
            attack="loss_mia",
            strength=ldm_base if sc == "ldm-t2i" else 0.0,
            seed=s,
        )
        for sc in ("ldm-t2i", "llm-text")
        for s in range(3)
    ]
    for d, st, fid in (("lora", 2.5, 1.0), ("mp_lora", 0.0, 3.0), ("smp_lora", 0.05, 1.2)):
        for s in range(3):  # ldm-t2i's utility keys carry the feature extractor's name
            recs.append(
                rec(
                    scenario="ldm-t2i",
                    task="ldm-t2i",
                    defense=d,
                    attack="loss_mia",
                    view="released_model",
                    strength=st,
                    seed=s,
                    utility={"fid_effnetlite0": fid + 0.01 * s, "kid_effnetlite0": 0.1},
                )
            )
    for d, st, loss in (("fedavg", 2.5, 3.0), ("dp_fedlora", 0.1, 3.3)):
        priv = {"epsilon": 2.0, "epsilon_composed": composed, "delta": 1e-5, "note": ""} if d == "dp_fedlora" else None
        for s in range(2):  # a utility clause is decided on an interval over seeds
            recs.append(
                rec(
                    scenario="llm-text",
                    task="llm-text",
                    defense=d,
                    attack="loss_mia",
                    strength=st,
                    seed=s,
                    utility={"test_loss": loss + 0.01 * s},
                    privacy=priv,
                )
            )
    extra = {"num_classes": num_classes} if num_classes else {}
    for d, lab, ssim, acc in (
        ("fedsgd", "fedsgd", [0.9, 0.8, 0.85, 0.95], ref_accuracy),
        ("flrsp", "flrsp(R=0.8,form=fedsgd)", [0.1, 0.05, 0.12, 0.08], ref_accuracy - 0.02),
    ):
        for s in range(2):
            recs.append(
                rec(
                    scenario="image-cls",
                    task="image-cls/vit",
                    defense=d,
                    label=lab,
                    params={"R": 0.8, "form": "fedsgd"} if d == "flrsp" else {},
                    attack=recon_attack,
                    kind="reconstruction",
                    view="client_update",
                    seed=s,
                    ssim=ssim,
                    utility={"accuracy": acc + 0.001 * s, **extra},
                    targets=[f"t:{i}" for i in range(len(ssim))],
                )
            )
            recs[-1]["per_candidate"]["variants"]["ssim_random"] = [0.01, 0.02, 0.0, 0.01]  # the negative control
    return recs


def test_smp_lora_and_dp_fedlora_and_flrsp_claims(tmp_path):
    res = write(tmp_path, _claim_records())

    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}

    for k in (("papers/004", "ldm-t2i"), ("papers/002", "llm-text"), ("papers/003", "image-cls")):
        assert got[k]["verdict"] == "holds", got[k]["evidence"]
    # the fid_effnetlite0 key is found (the utility clause is not dropped); the oracle ASR is never used
    assert "fid_effnetlite0" in got[("papers/004", "ldm-t2i")]["evidence"]
    assert "asr_aux not measured" in got[("papers/004", "ldm-t2i")]["evidence"]


def test_smp_lora_near_chance_says_nothing_where_the_baseline_does_not_leak_either(tmp_path):
    # arrange: the base model scores like LoRA, so LoRA's released-model control fails
    res = write(tmp_path, _claim_records(ldm_base=2.5))

    # act
    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}[("papers/004", "ldm-t2i")]

    # assert: neither "leaks less than LoRA" nor "near 0.5" holds; the utility clause is still decided
    assert got["verdict"] == "inconclusive", got["evidence"]
    assert "(near 0.5 = within 0.1); the baseline's positive control in released_model FAILED" in got["evidence"]
    assert "smp_lora" in got["evidence"] and "vs mp_lora" in got["evidence"] and "-> holds" in got["evidence"]


def test_the_flrsp_claim_covers_the_papers_attack_of_each_architecture_only(tmp_path):
    # [FLRSP] runs APRIL on the ViT and inverting gradients on ResNet34: a ViT inversion cell is not its claim
    res = write(tmp_path, _claim_records(recon_attack="inverting_gradients"))

    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}

    assert got[("papers/003", "image-cls")]["verdict"] == "not measured", got[("papers/003", "image-cls")]


def test_a_dp_claim_with_a_meaningless_epsilon_holds_only_nominally(tmp_path):
    res = write(tmp_path, _claim_records(composed=5.2e3))

    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}

    assert got[("papers/002", "llm-text")]["verdict"] == "holds only nominally"
    assert "only nominal" in got[("papers/002", "llm-text")]["evidence"]


def test_comparable_accuracy_at_chance_is_inconclusive(tmp_path):
    # FedSGD and FLRSP at 0.17 / 0.15 on 10 classes: both at chance, "comparable accuracy" means nothing
    res = write(tmp_path, _claim_records(ref_accuracy=0.12, num_classes=10))

    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}

    assert got[("papers/003", "image-cls")]["verdict"] == "inconclusive"
    assert "at chance" in got[("papers/003", "image-cls")]["evidence"]


def test_a_missing_utility_key_is_reported_not_dropped(tmp_path):
    recs = [r for r in _claim_records() if r["scenario"] == "ldm-t2i"]
    for r in recs:
        r["utility"] = {"n_generated": 4.0}
    res = write(tmp_path, recs)

    got = {(c["paper"].split()[0], c["scenario"]): c for c in _paper_rows(res)}

    assert got[("papers/004", "ldm-t2i")]["verdict"] == "not measured"
    assert "could not evaluate: KeyError" in got[("papers/004", "ldm-t2i")]["evidence"]
    with pytest.raises(KeyError, match="no utility"):
        claims.main_utility(res, res.records)


def test_records_of_a_superseded_task_configuration_are_not_pooled_with_the_current_ones(tmp_path):
    # arrange: the same cell under an old configuration (weak leakage) and, started later, a new one (strong)
    old = rec(strength=0.0, seed=0)
    old["cell_id"] += "-old"
    old["provenance"] = {"code_version": "test", "config_hash": "aaaa", "started_at": "2026-01-01T00:00:00Z"}
    new = rec(strength=3.0, seed=0)
    new["provenance"] = {"code_version": "test", "config_hash": "bbbb", "started_at": "2026-01-02T00:00:00Z"}
    other = rec(task="sc/b", strength=0.0)  # another task keeps its own (only) configuration
    # act
    res = write(tmp_path, [old, new, other])
    # assert: only the newest configuration of sc/a is kept, and the drop is counted
    kept = res.select(task="sc/a")
    assert [r["provenance"]["config_hash"] for r in kept] == ["bbbb"]
    assert res.superseded == {("sc/a", "smoke"): 1}
    assert len(res.select(task="sc/b")) == 1
    assert res.metric(kept, "auroc").value == pytest.approx(new["metrics"]["auroc"]["value"], abs=1e-9)


def test_seeds_counted_are_the_seeds_with_results(tmp_path):
    """An n/a record of another seed (a cell that does not apply) adds no seed to the row."""
    res = write(
        tmp_path,
        [
            rec(defense="fedavg", seed=0),
            rec(defense="fedavg", seed=1, attack="april", status="n/a", reason="needs a ViT"),
            rec(defense="fedavg", seed=2, attack="april", status="n/a", reason="needs a ViT"),
        ],
    )

    row = scenario_table(res, "sc")[0].set_index("defense").loc["fedavg"]

    assert row["n_seeds"] == 1 and row["seeds"] == "0"


def test_the_runs_control_warning_reads_only_the_latest_configuration(tmp_path, capsys):
    """`bench run`'s positive-control warning selects records like the leaderboards (superseded ones dropped)."""
    from bench.cli import warn_positive_controls

    old = rec(strength=0.0, seed=0)  # an old configuration at chance: its control would fail
    old["cell_id"] += "-old"
    old["provenance"] = {"code_version": "test", "config_hash": "aaaa", "started_at": "2026-01-01T00:00:00Z"}
    base_old = rec(defense="base", strength=0.0, seed=0)
    base_old["cell_id"] += "-old"
    base_old["provenance"] = dict(old["provenance"])
    new = rec(strength=4.0, seed=0, n=300)
    new["provenance"] = {"code_version": "test", "config_hash": "bbbb", "started_at": "2026-01-02T00:00:00Z"}
    base_new = rec(defense="base", strength=0.0, seed=0, n=300)
    base_new["provenance"] = dict(new["provenance"])
    write(tmp_path, [old, base_old])
    warn_positive_controls(tmp_path)
    assert "positive control failed" in capsys.readouterr().err  # the old configuration alone fails

    write(tmp_path, [new, base_new])
    warn_positive_controls(tmp_path)

    assert "positive control failed" not in capsys.readouterr().err
