"""Statistics and verdict machinery of the reporting (issue 11): TPR-at-FPR gating, the paired bootstrap, the
positive-control criterion, utility collapse, escaping, and a run where every cell is n/a (constructed records)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from bench import controls
from bench.bootstrap import AUROC, Drawn, MemberStat, draw_stat, hierarchical, percentile_interval, rank_rows
from bench.metrics import membership_metrics, membership_point
from bench.pigeonhole import Seed, aligned, crossed, pigeonhole, record_seeds, seeds_of, weighted
from bench.report import reported
from bench.report.leaderboards import write_leaderboards
from bench.report.paired import difference, mde, paired_difference, unpaired_difference
from bench.report.results import Results
from bench.report.tables import scenario_table
from bench.schema import validate
from tests.test_leaderboard import rec, write

# ----------------------------------------------------------------------------------------------
# TPR at FPR f only with >= 10 / f non-members


def test_tpr_at_low_fpr_is_not_reported_without_enough_non_members():
    rng = np.random.default_rng(0)
    s, y = rng.normal(size=400), np.array([1] * 200 + [0] * 200)

    point = membership_point(s, y)
    metrics, _ = membership_metrics(s, y, n_boot=20)

    assert "tpr@0.05fpr" in point and "tpr@0.01fpr" not in point and "tpr@0.001fpr" not in point
    assert metrics["tpr@0.05fpr"]["value"] is not None
    assert metrics["tpr@0.01fpr"]["value"] is None
    assert metrics["tpr@0.01fpr"]["reason"] == "n/a: needs >= 1000 non-members for FPR 0.01, has 200"
    assert "asr_oracle" in point and "asr" not in point  # best threshold on the evaluation set: named for it


def test_old_records_asr_is_read_as_the_oracle_asr(tmp_path):
    r = rec()
    r["metrics"]["asr"] = r["metrics"].pop("asr_oracle")

    res = Results([r])

    assert "asr_oracle" in res.records[0]["metrics"] and "asr" not in res.records[0]["metrics"]


# ----------------------------------------------------------------------------------------------
# paired bootstrap


def test_the_paired_interval_of_a_row_minus_itself_is_zero():
    recs = [rec(seed=s, strength=1.0) for s in range(3)]

    d = paired_difference(recs, recs, "auroc", key="self")

    assert (d.value, d.lo, d.hi) == (0.0, 0.0, 0.0)
    assert d.method.startswith("paired") and mde(d) == 0.0


def test_paired_interval_of_two_independent_chance_rows_covers_zero_about_95_percent():
    rng = np.random.default_rng(1)
    n, sims, covered = 60, 200, 0
    y = np.array([1] * n + [0] * n)
    for _ in range(sims):
        a, b = rng.normal(size=2 * n), rng.normal(size=2 * n)  # no leakage in either row, independent
        ids = [str(i) for i in range(2 * n)]
        seeds = [Seed(ids[:n], ids[n:], [a[y == 1], b[y == 1]], [a[y == 0], b[y == 0]])]
        ra, rb = pigeonhole(seeds, AUROC, rng, 400)
        lo, hi = percentile_interval(ra - rb)
        covered += lo <= 0 <= hi

    assert 0.9 <= covered / sims <= 0.99


def test_without_candidate_ids_the_difference_is_unpaired_and_says_so(tmp_path):
    res = write(tmp_path, [rec(defense="fedavg", strength=2.0, ids=False), rec(defense="x", strength=0.0, ids=False)])
    a, b = res.select(defense="fedavg"), res.select(defense="x")

    assert record_seeds([a, b], [None, None]) is None
    d = difference(res, a, b, "auroc", leak=False)

    assert d.method.startswith("unpaired") and d.lo > 0


# ----------------------------------------------------------------------------------------------
# reconstruction rows paired on their target ids (bench.report.targets)

TARGETS = [f"photo:{i}" for i in range(4)] + [f"client0:{i}" for i in range(8)]


def _recon(defense: str, ssim, *, seed: int = 0, targets=TARGETS) -> dict:
    return rec(
        defense=defense, attack="ig", kind="reconstruction", view="client_update", seed=seed, ssim=ssim, targets=targets
    )


def test_a_reconstruction_row_minus_itself_is_zero_paired(tmp_path):
    rng = np.random.default_rng(0)
    res = write(tmp_path, [_recon("fedavg", rng.uniform(0, 1, 12).tolist(), seed=s) for s in range(3)])
    recs = res.select(defense="fedavg")

    d = difference(res, recs, recs, "ssim")

    assert (d.value, d.lo, d.hi) == (0.0, 0.0, 0.0)
    assert d.method == "paired bootstrap over 3 seeds x 12 targets (crossed)" and mde(d) == 0.0


def test_reconstruction_rows_sharing_target_ids_are_paired_by_id(tmp_path):
    # arrange: per-target difficulty shared by both rows; flrsp lists its targets in another order, plus one more
    rng = np.random.default_rng(1)
    recs = []
    for s in range(2):
        hard = rng.uniform(0.0, 0.8, 12)
        recs.append(_recon("fedavg", (hard + 0.1).tolist(), seed=s))
        order = rng.permutation(12)
        mine = (hard + rng.normal(0, 0.01, 12))[order].tolist() + [0.99]
        recs.append(_recon("flrsp", mine, seed=s, targets=[TARGETS[i] for i in order] + ["photo:extra"]))
    res = write(tmp_path, recs)
    a, b = res.select(defense="flrsp"), res.select(defense="fedavg")

    # act
    d, d_psnr = difference(res, a, b, "ssim"), difference(res, a, b, "psnr")
    u = unpaired_difference(res.metric(a, "ssim"), res.metric(b, "ssim"))

    # assert: aligned by id on the 12 shared targets of each seed; the unpaired interval cannot tell
    assert d.method == d_psnr.method == "paired bootstrap over 2 seeds x 12 targets (crossed)"
    assert d.value == pytest.approx(-0.1, abs=0.01) and d.hi < 0
    assert d_psnr.value == pytest.approx(-1.0, abs=0.1) and d_psnr.hi < 0  # psnr from per_candidate.variants
    assert u.lo < 0 < u.hi and d.hi - d.lo < (u.hi - u.lo) / 5


def test_old_reconstruction_records_without_target_ids_compare_unpaired(tmp_path):
    hi, lo = [0.9, 0.8, 0.7, 0.85], [0.3, 0.2, 0.1, 0.25]
    cases = {
        "old": (None, None),  # neither record names its targets (written before they were kept)
        "mixed": (TARGETS[:4], None),
        "disjoint": (TARGETS[:4], TARGETS[4:8]),
    }
    for name, (ta, tb) in cases.items():
        res = write(tmp_path / name, [_recon("fedavg", hi, targets=ta), _recon("flrsp", lo, targets=tb)])
        a, b = res.select(defense="flrsp"), res.select(defense="fedavg")

        assert paired_difference(a, b, "ssim") is None, name
        d = difference(res, a, b, "ssim")
        assert d.method.startswith("unpaired") and d.hi < 0, name


def test_the_schema_takes_reconstruction_target_ids_and_still_needs_members_for_membership():
    good = {"schema_version": 1, **_recon("fedavg", [0.5, 0.6], targets=["t:0", "t:1"])}
    short = {**good, "per_candidate": {**good["per_candidate"], "id": ["t:0"]}}
    member = {"schema_version": 1, **rec()}
    del member["per_candidate"]["member"]

    assert validate(good) is None
    assert "lengths {'id': 1}" in validate(short)
    assert "needs per_candidate with member" in validate(member)


# ----------------------------------------------------------------------------------------------
# reconstruction control: the undefended baseline's SSIM against random images' on the same targets


def _recon_ctrl(defense: str, ssim, noise, *, seed: int = 0) -> dict:
    r = _recon(defense, ssim, seed=seed)
    if noise is not None:
        r["per_candidate"]["variants"]["ssim_random"] = list(noise)
    return r


def test_reconstruction_control_passes_fails_or_is_not_checked():
    rng = np.random.default_rng(0)
    noise = [rng.uniform(0.0, 0.02, 12).tolist() for _ in range(3)]
    clear = [_recon_ctrl("fedsgd", (np.array(z) + 0.4).tolist(), z, seed=s) for s, z in enumerate(noise)]
    faint = [
        _recon_ctrl("fedavg", (np.array(z) + rng.normal(0.03, 0.05, 12)).tolist(), z, seed=s)
        for s, z in enumerate(noise)
    ]
    old = [_recon_ctrl("fedsgd", [0.9] * 12, None, seed=0) | {"task": "sc/b"}]

    out = {(c.task, c.baseline): c for c in controls.reconstruction_controls(clear + faint + old)}

    assert out[("sc/a", "fedsgd")].passed and out[("sc/a", "fedsgd")].gap == pytest.approx(0.4)
    assert not out[("sc/a", "fedavg")].passed and "< 0.1" in out[("sc/a", "fedavg")].reason
    assert not out[("sc/b", "fedsgd")].passed and out[("sc/b", "fedsgd")].reason.startswith("not checked")
    assert controls.failures(clear + faint + old) == [out[("sc/a", "fedavg")].line()]  # not checked: no warning


def test_a_lower_end_just_under_the_threshold_is_not_printed_equal_to_it():
    assert controls._near(0.0997, 0.1) == "+0.0997"  # "+0.100 < 0.1" would read as a contradiction
    assert controls._near(0.0899, 0.1) == "+0.090"
    assert controls._near(0.25, 0.1) == "+0.250"


def test_a_reconstruction_clause_against_a_baseline_at_random_level_is_inconclusive_not_contradicted(tmp_path):
    from bench.report.clauses import leakage_comparisons

    rng = np.random.default_rng(1)
    recs = []
    for s in range(3):
        z = rng.uniform(0.0, 0.02, 12)
        recs.append(_recon_ctrl("fedavg", (z + 0.01).tolist(), z.tolist(), seed=s))  # the attack does not work
        recs.append(_recon_ctrl("flrsp", (z + 0.2).tolist(), z.tolist(), seed=s))  # "leaks more": noise, not evidence
    res = write(tmp_path, recs)

    (clause, *_rest) = leakage_comparisons(
        res, "sc", "smoke", "flrsp", "fedavg", views=("client_update",), kind="reconstruction", effect=0.1
    )

    assert clause["verdict"] == "inconclusive"
    assert "reconstruction control FAILED" in clause["text"]


# ----------------------------------------------------------------------------------------------
# positive control (bench.controls: pure numpy, the harness may call it)


def _task(fedavg_strength: float, base_strength: float, *, n: int = 64, task: str = "sc/a") -> list[dict]:
    recs = [rec(task=task, defense="base", strength=base_strength, n=n)]
    recs += [
        rec(task=task, defense="fedavg", strength=fedavg_strength, view=v, n=n)
        for v in ("global_model", "client_model")
    ]
    recs += [rec(task=task, defense="fedavg", attack="weak", strength=0.0, n=n)]  # the strongest attack is judged
    return recs


def test_positive_control_passes_when_the_baseline_leaks_clearly_above_the_base_model():
    out = controls.positive_controls(_task(2.5, 0.0))

    assert [(c.view, c.passed, c.attack) for c in out] == [("client_model", True, "mia"), ("global_model", True, "mia")]
    assert all(c.paired and c.gap_lo >= controls.GAP_MIN for c in out)
    assert all(c.reason.endswith("(paired, 1 seed(s))") for c in out)  # the judged attack's seeds are named
    assert controls.failures(_task(2.5, 0.0)) == []


def test_positive_control_fails_by_auroc():
    out = controls.positive_controls(_task(0.5, 0.0))

    assert not any(c.passed for c in out)
    assert all("< 0.75 (1 seed(s))" in c.reason for c in out)


def test_positive_control_fails_by_the_gap_over_the_base_model():
    out = controls.positive_controls(_task(2.5, 2.3))  # the un-fine-tuned model separates them almost as well

    assert not any(c.passed for c in out)
    assert all("interval lower end" in c.reason and c.paired for c in out)
    assert len(controls.failures(_task(2.5, 2.3))) == 2


def test_the_leaderboard_marks_a_task_whose_baseline_fails_its_control(tmp_path):
    write(tmp_path / "run", _task(0.5, 0.0))

    write_leaderboards(tmp_path / "run", tmp_path / "lb")

    md = (tmp_path / "lb" / "sc.md").read_text()
    assert "Positive control failed for sc/a" in md
    import pandas as pd

    table = pd.read_csv(tmp_path / "lb" / "sc.csv")
    assert table.positive_control.str.startswith("failed").all()


def test_the_control_banner_names_only_the_view_that_fails_and_leaves_the_others_verdicts(tmp_path):
    recs = [r for r in _task(2.5, 0.0) if r["view"] != "global_model" or r["defense"] == "base"]
    recs += [rec(task="sc/a", defense="fedavg", strength=0.0, view="global_model", n=64)]  # only the global view fails
    write(tmp_path / "run", recs)

    write_leaderboards(tmp_path / "run", tmp_path / "lb")

    md = (tmp_path / "lb" / "sc.md").read_text()
    banner = [line for line in md.splitlines() if "Positive control failed" in line]
    assert len(banner) == 1
    assert "global_model view" in banner[0] and "client_model" not in banner[0]
    assert "keep their verdicts" in banner[0]


def test_the_index_lists_every_positive_control_and_which_fail(tmp_path):
    write(tmp_path / "run", _task(0.5, 0.0) + _task(2.5, 0.0, task="sc/b"))

    write_leaderboards(tmp_path / "run", tmp_path / "lb")

    index = (tmp_path / "lb" / "README.md").read_text()
    section = index.split("## Positive controls", 1)[1]
    assert "2 of 4 passed" in section
    rows = [line for line in section.splitlines() if line.startswith("| sc/")]
    assert sorted((r.split("|")[1].strip(), "FAILED" in r) for r in rows) == [
        ("sc/a", True),
        ("sc/a", True),
        ("sc/b", False),
        ("sc/b", False),
    ]


# ----------------------------------------------------------------------------------------------
# utility collapse, escaping, DP display, all-n/a runs, reported-vs-measured settings


def test_a_collapsed_row_is_never_in_the_best_group_and_is_marked(tmp_path):
    res = write(
        tmp_path,
        [
            rec(defense="fedavg", strength=2.0, utility={"perplexity": 20.0}),
            rec(defense="dp", label="dp(eps=1)", strength=0.0, utility={"perplexity": 2.2e8}),
            rec(defense="flrsp", label="flrsp(R=0.8)", strength=0.05, utility={"perplexity": 25.0}),
        ],
    )

    table, _ = scenario_table(res, "sc")

    t = table.set_index("defense")
    assert "perplexity" in t.loc["dp(eps=1)", "utility_collapse"]
    assert t.loc["dp(eps=1)", "mia/global_model:auroc.best"] == 0
    assert t.loc["flrsp(R=0.8)", "mia/global_model:auroc.best"] == 1
    assert t.loc["fedavg", "utility_collapse"] == ""


def test_an_fid_named_by_its_feature_extractor_is_checked_for_collapse(tmp_path):
    res = write(
        tmp_path,
        [
            rec(defense="fedavg", strength=2.0, utility={"fid_effnetlite0": 130.0, "fid_effnetlite0_std": 1.0}),
            rec(defense="dp", label="dp(eps=1)", strength=0.0, utility={"fid_effnetlite0": 420.0}),
            rec(defense="flrsp", label="flrsp(R=0.8)", strength=0.05, utility={"fid_effnetlite0": 133.0}),
        ],
    )

    t = scenario_table(res, "sc")[0].set_index("defense")

    assert "FID 420 > 3x baseline 130" in t.loc["dp(eps=1)", "utility_collapse"]
    assert t.loc["flrsp(R=0.8)", "utility_collapse"] == "" and t.loc["fedavg", "utility_collapse"] == ""


def test_markdown_escapes_record_strings_and_shows_epsilon_without_amplification(tmp_path):
    priv = {
        "epsilon": 1.0,
        "epsilon_composed": 3.0,
        "epsilon_composed_no_amplification": 9.0,
        "delta": 1e-5,
        "note": "<b>note</b>",
    }
    write(
        tmp_path / "run",
        [
            rec(defense="fedavg"),
            rec(defense="dp", label="dp(eps=1)", privacy=priv),
            rec(defense="x", label="<script>alert(1)</script>", status="failed", reason="<img src=x>"),
        ],
    )

    write_leaderboards(tmp_path / "run", tmp_path / "lb")

    md = (tmp_path / "lb" / "sc.md").read_text()
    assert "<script>" not in md and "<img" not in md and "<b>" not in md
    assert "&lt;script&gt;" in md
    assert "epsilon composed (no amplification)" in md and "| 9 " in md.replace("9.00", "9 ")


def test_a_run_where_every_cell_is_na_writes_its_leaderboard(tmp_path):
    write(
        tmp_path / "run",
        [
            rec(
                scenario="image-cls",
                task="image-cls/vit",
                attack="max_renyi",
                status="n/a",
                reason="needs a language model",
            )
        ],
    )

    written = write_leaderboards(tmp_path / "run", tmp_path / "lb")

    assert (tmp_path / "lb" / "image-cls.md").is_file() and written
    assert "needs a language model" in (tmp_path / "lb" / "image-cls.md").read_text()


def test_reported_numbers_are_only_set_beside_measurements_of_the_same_setting(tmp_path):
    var = {"maxrenyi_K0_a0.5_text": {"auroc": 0.7}}
    res = write(tmp_path, [rec(scenario="llm-text", task="llm-text", attack="max_renyi", variants=var)])

    out = reported.compare(res)

    fortunes = out[(out.paper == "papers/000") & (out.table == "Table 4") & (out.scenario == "llm-text")]
    assert len(fortunes) and not fortunes.same_setting.any()  # MSCOCO/NoCaps is not the fortunes text setting
    assert out[(out.paper == "papers/000") & (out.scenario == "vlm-caption")].same_setting.all()


@pytest.mark.parametrize("kind", ["ties", "continuous", "nan", "inf"])
def test_rank_rows_equals_scipy_rankdata_exactly(kind):
    from scipy.stats import rankdata

    rng = np.random.default_rng(7)
    for _ in range(200):
        b, n = int(rng.integers(1, 5)), int(rng.integers(1, 50))
        x = rng.integers(0, 4, (b, n)).astype(float) if kind == "ties" else rng.normal(size=(b, n))
        if kind == "nan":
            x[rng.random((b, n)) < 0.05] = np.nan
        if kind == "inf":
            x[rng.random((b, n)) < 0.2] = np.inf * rng.choice([-1.0, 1.0])

        got = rank_rows(x)

        assert np.array_equal(got, rankdata(x, axis=1), equal_nan=True)


@pytest.mark.parametrize("metric", ["auroc", "advantage", "tpr@0.1fpr", "tpr@0.02fpr", "tpr@0.5fpr"])
@pytest.mark.parametrize("kind", ["ties", "continuous", "nan"])
def test_statistic_on_drawn_indices_equals_it_on_drawn_values_exactly(metric, kind):
    from bench.bootstrap import Drawn, member_stat

    rng = np.random.default_rng(3)
    stat = member_stat(metric)
    for _ in range(60):
        n1, n0 = int(rng.integers(1, 40)), int(rng.integers(1, 120))
        pos, neg = ((rng.integers(0, 5, n).astype(float) if kind == "ties" else rng.normal(size=n)) for n in (n1, n0))
        if kind == "nan":
            neg[rng.random(n0) < 0.1] = np.nan
        i, m = rng.integers(0, n1, (17, n1)), rng.integers(0, n0, (17, n0))

        got = stat.drawn(Drawn(pos, neg), i, m)

        assert np.array_equal(got, stat(pos[i], neg[m]), equal_nan=True)


# ----------------------------------------------------------------------------------------------
# crossed designs: every seed attacks the same targets


def test_the_crossed_bootstrap_covers_a_persistent_target_effect_that_the_nested_one_misses():
    # arrange: 3 seeds x the same 8 targets; each target's difficulty persists across seeds (sd 0.2), the seeds
    # add little (sd 0.05): the mean's uncertainty is mostly which 8 targets were drawn
    rng = np.random.default_rng(0)
    n_sim, covered_crossed, covered_nested = 300, 0, 0

    def nested_draw(g, b, r):
        return g[r.integers(0, len(g), (b, len(g)))].mean(1)

    # act
    for _ in range(n_sim):
        table = 0.3 + rng.normal(0, 0.2, 8)[None, :] + rng.normal(0, 0.05, (3, 8))
        lo, hi = percentile_interval(crossed([table], rng, 1000)[0])
        covered_crossed += lo <= 0.3 <= hi
        lo, hi = percentile_interval(hierarchical(list(table), nested_draw, rng, 1000))
        covered_nested += lo <= 0.3 <= hi

    # assert: near the nominal 95% (8 targets: the percentile bootstrap runs a little short) against ~75%
    assert covered_crossed / n_sim >= 0.85
    assert covered_nested / n_sim <= 0.80


def test_crossed_replicates_share_one_draw_across_tables_and_reduce_to_the_target_bootstrap_with_one_seed():
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, (3, 8))

    ra, rb = crossed([a, a + 0.25], rng, 500)
    (one,) = crossed([a[:1]], np.random.default_rng(4), 2000)

    assert np.allclose(rb - ra, 0.25)  # the same seeds and targets drawn for both tables
    assert one.mean() == pytest.approx(a[0].mean(), abs=0.01) and one.std() == pytest.approx(
        a[0].std() / np.sqrt(8), rel=0.1
    )
    assert aligned([{"x": 1.0, "y": 2.0}, {"y": 3.0, "x": 4.0}]).tolist() == [[1.0, 2.0], [4.0, 3.0]]
    assert aligned([{"x": 1.0}, {"y": 2.0}]) is None and aligned([{"x": 1.0}, None]) is None


def test_the_weighted_statistics_equal_the_drawn_ones_on_the_same_draws():
    # arrange: 300 members and 300 non-members with ties; 50 bootstrap draws as index arrays and as counts
    rng = np.random.default_rng(5)
    pos, neg = np.round(rng.normal(0.5, 1, 300), 1), np.round(rng.normal(0, 1, 300), 1)
    i, m = rng.integers(0, 300, (50, 300)), rng.integers(0, 300, (50, 300))
    wp = np.stack([np.bincount(r, minlength=300) for r in i]).astype(float)
    wn = np.stack([np.bincount(r, minlength=300) for r in m]).astype(float)

    for stat in (AUROC, MemberStat("advantage"), MemberStat("tpr@0.05fpr", 0.05)):
        # act
        got = weighted(stat, pos, neg, wp, wn)
        # assert
        assert np.allclose(got, stat.drawn(Drawn(pos, neg), i, m)), stat.metric


def test_the_pigeonhole_bootstrap_covers_candidates_shared_by_every_seed_where_the_nested_one_does_not():
    # arrange: the same 40 + 40 candidates in 5 seeds; each candidate's score level persists across seeds (sd 1),
    # a seed moves it a little (sd 0.1): the population AUROC is Phi(d / sqrt(2 x 1.01))
    rng = np.random.default_rng(2)
    d, n, sims = 1.0, 40, 200
    truth = norm.cdf(d / np.sqrt(2 * 1.01))
    ids = [str(i) for i in range(2 * n)]
    covered_pigeonhole = covered_nested = 0

    # act
    for _ in range(sims):
        level = np.concatenate([rng.normal(d, 1, n), rng.normal(0, 1, n)])
        scores = [level + rng.normal(0, 0.1, 2 * n) for _ in range(5)]
        seeds = [Seed(ids[:n], ids[n:], [s[:n]], [s[n:]]) for s in scores]
        lo, hi = percentile_interval(pigeonhole(seeds, AUROC, rng, 400)[0])
        covered_pigeonhole += lo <= truth <= hi
        groups = [Drawn(s[:n], s[n:]) for s in scores]
        lo, hi = percentile_interval(hierarchical(groups, lambda g, b, r: draw_stat(AUROC, g, b, r), rng, 400))
        covered_nested += lo <= truth <= hi

    # assert
    assert covered_pigeonhole / sims >= 0.88  # 0.92-0.97 over three generator seeds
    assert covered_nested / sims <= 0.75  # 0.58-0.64: the same candidates counted as 5 independent draws


def test_seeds_keep_the_candidates_every_row_scored_with_the_same_membership():
    a = {0: {"a": (0.9, 1), "b": (0.8, 1), "c": (0.1, 0), "d": (0.2, 0), "e": (0.3, 0)}, 1: None}
    b = {0: {"a": (0.5, 1), "b": (0.4, 1), "c": (0.6, 1), "d": (0.1, 0)}}

    (seed,) = seeds_of([a, b])  # seed 1: only row a has it

    assert (seed.pos_ids, seed.neg_ids) == (["a", "b"], ["d"])  # c: labelled differently; e: row b lacks it
    assert [x.tolist() for x in seed.pos] == [[0.9, 0.8], [0.5, 0.4]] and [x.tolist() for x in seed.neg] == [
        [0.2],
        [0.1],
    ]
    assert seeds_of([a, {1: b[0]}]) is None  # the shared seed's record of row a has no ids
