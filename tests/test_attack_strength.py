"""The [RMIA] positive control of the leaderboards (``bench.report.strength``): RMIA against the best single-signal
attack in TPR at the lowest FPR the non-members support, on the undefended baseline (synthetic records)."""

from __future__ import annotations

import pytest

from bench.report import strength
from bench.report.leaderboards import write_leaderboards
from bench.report.results import Results
from tests.test_leaderboard import member_scores, rec, write

N = 200  # members and non-members per seed: the fewest that report TPR at 5% FPR


def rmia_rec(strength_: float, *, score_seed: int | None = None, neg_loss_tpr: float | None = None, **kw) -> dict:
    """An rmia record (primary ``rmia``) with a kept ``lira_offline`` and an unkept ``neg_loss`` variant."""
    r = rec(attack="rmia", strength=strength_, n=N, score_seed=score_seed, **kw)
    lira, _ = member_scores(strength_, N, 99)
    r["primary"] = "rmia"
    r["per_candidate"]["variants"] = {"lira_offline": lira}
    r["variants"] = {
        "rmia": {"tpr@0.05fpr": r["metrics"]["tpr@0.05fpr"]["value"]},
        "lira_offline": {"tpr@0.05fpr": 0.5},
        "neg_loss": {"tpr@0.05fpr": 0.0 if neg_loss_tpr is None else neg_loss_tpr},
    }
    return r


def row_of(recs: list[dict]) -> dict:
    df = strength.strength_table(Results(recs), "sc")
    assert len(df) == 1
    return df.iloc[0].to_dict()


@pytest.mark.parametrize("n_nonmembers, fpr", [(199, None), (200, 0.05), (999, 0.05), (1000, 0.01), (10_000, 0.001)])
def test_the_fpr_is_the_lowest_the_non_member_count_supports(n_nonmembers, fpr):
    assert strength.lowest_fpr(n_nonmembers) == fpr


def test_rmia_stronger_when_the_paired_interval_lies_above_zero():
    recs = [rmia_rec(3.0), rec(attack="loss_mia", strength=0.0, n=N)]

    row = row_of(recs)

    assert (row["fpr"], row["n_nonmembers"], row["best_single"]) == (0.05, 200, "loss_mia")
    assert row["paired"] and row["difference.ci_low"] > 0
    assert row["verdict"] == strength.STRONGER and row["reference_best"] == "rmia"
    assert row["lira_offline.tpr.ci_low"] < row["lira_offline.tpr"] < row["lira_offline.tpr.ci_high"]


def test_not_stronger_when_the_paired_interval_lies_below_zero():
    recs = [rmia_rec(0.0), rec(attack="loss_mia", strength=3.0, n=N)]

    row = row_of(recs)

    assert row["difference.ci_high"] < 0 and row["verdict"] == strength.NOT_STRONGER


def test_inconclusive_when_the_paired_interval_contains_zero():
    recs = [rmia_rec(1.0, score_seed=7), rec(attack="loss_mia", strength=1.0, n=N)]

    row = row_of(recs)

    assert row["difference.ci_low"] < 0 < row["difference.ci_high"] and row["verdict"] == strength.INCONC


def test_a_row_minus_itself_is_exactly_zero_and_not_stronger():
    recs = [rmia_rec(1.0), rec(attack="loss_mia", strength=1.0, n=N)]  # the same scores on the same candidates

    row = row_of(recs)

    assert (row["difference"], row["difference.ci_low"], row["difference.ci_high"]) == (0.0, 0.0, 0.0)
    assert row["paired"] and row["verdict"] == strength.NOT_STRONGER


def test_the_stronger_of_rmia_and_offline_lira_is_judged_paired_on_its_own_scores():
    r = rmia_rec(0.0)  # RMIA's primary at chance
    r["per_candidate"]["variants"]["lira_offline"] = member_scores(3.0, N, 0)[0]  # a strong offline LiRA
    r["variants"]["lira_offline"] = {"tpr@0.05fpr": 0.95}

    row = row_of([r, rec(attack="loss_mia", strength=0.0, n=N)])

    assert row["reference_best"] == "lira_offline" and row["paired"]
    assert row["difference.ci_low"] > 0 and row["verdict"] == strength.STRONGER
    assert row["rmia.tpr"] < 0.3


def test_a_kept_variant_pairs_on_its_own_scores():
    mr = rec(attack="max_renyi", strength=0.0, n=N)
    mr["per_candidate"]["variants"] = {"k0": member_scores(1.0, N, 0)[0]}  # rmia_rec(1.0)'s scores, kept
    mr["variants"] = {"k0": {"tpr@0.05fpr": 0.9}}

    row = row_of([rmia_rec(1.0), mr])

    assert row["best_single"] == "max_renyi:k0" and row["paired"]
    assert (row["difference"], row["difference.ci_low"], row["difference.ci_high"]) == (0.0, 0.0, 0.0)


def test_a_variant_without_kept_scores_is_compared_unpaired_and_the_note_says_so():
    recs = [rmia_rec(1.0, neg_loss_tpr=0.99), rec(attack="loss_mia", strength=0.0, n=N)]

    row = row_of(recs)

    assert row["best_single"] == "rmia:neg_loss" and row["best_single.tpr"] == 0.99
    assert not row["paired"] and row["difference.method"].startswith("unpaired")
    assert "not kept: unpaired" in row["note"] and row["verdict"] == strength.INCONC


def test_only_the_undefended_baseline_of_the_protocol_is_judged_and_too_few_non_members_say_why():
    recs = [rmia_rec(3.0, defense="flrsp"), rec(attack="loss_mia", defense="flrsp", n=N)]  # not a baseline
    recs += [rec(attack="loss_mia", defense="fedavg", view="released_model", n=N)]  # released: lora's protocol
    recs += [rec(attack="loss_mia", defense="fedsgd", n=50)]

    df = strength.strength_table(Results(recs), "sc")

    assert df[["baseline", "view"]].values.tolist() == [["fedsgd", "global_model"]]
    assert df.verdict[0] == strength.NOT_MEASURED
    assert df.note[0] == "n/a: needs >= 200 non-members for FPR 0.05, has 50"


def test_the_leaderboard_writes_the_section_and_a_numeric_csv(tmp_path):
    import pandas as pd

    write(tmp_path, [rmia_rec(3.0), rec(attack="loss_mia", strength=0.0, n=N)])

    write_leaderboards(tmp_path)

    csv = pd.read_csv(tmp_path / "leaderboards" / "sc_attack_strength.csv")
    assert csv["rmia.tpr"].dtype == float and csv["fpr"].tolist() == [0.05]
    md = (tmp_path / "leaderboards" / "sc.md").read_text()
    assert "## Attack strength on the undefended baseline" in md and f"**{strength.STRONGER}**" in md
    assert "sc_attack_strength.csv" in (tmp_path / "leaderboards" / "README.md").read_text()


def test_the_row_names_the_offline_a_each_seeds_rmia_record_used():
    recs = []
    for seed, a in ((1, 0.5), (0, 0.4)):
        r = rmia_rec(3.0, seed=seed, score_seed=seed)
        r["attack_details"] = {"rmia": {"a": a}}
        recs.append(r)
    legacy = rmia_rec(3.0, seed=2, score_seed=2)  # a record that does not state its a
    clients = rmia_rec(3.0, seed=3, score_seed=3)  # a client-view record: one a per client
    clients["attack_details"] = {"per_client": {"0": {"rmia": {"a": 1.0}}, "1": {"rmia": {"a": 0.9}}, "2": {}}}

    assert row_of(recs)["rmia.a"] == "0.4, 0.5"
    assert row_of([*recs, legacy, clients])["rmia.a"] == "0.4, 0.5, ?, 0.9/1"
    assert "(a 0.4, 0.5)" in strength.markdown(strength.strength_table(Results(recs), "sc"), "sc")


def test_the_best_base_calibrated_score_is_shown_beside_and_its_plain_loss_counts_as_single_signal():
    # arrange: ref_loss with a strong calibrated variant, a weak primary and its plain loss above loss_mia's
    ref = rec(attack="ref_loss", strength=0.5, n=N)
    ref["primary"] = "diff"
    tprs = {"diff": 0.3, "neg_ratio": 0.8, "neg_loss": 0.6}
    ref["variants"] = {k: {"tpr@0.05fpr": v} for k, v in tprs.items()}
    recs = [rmia_rec(3.0), rec(attack="loss_mia", strength=0.0, n=N), ref]

    # act
    row = row_of(recs)

    # assert: neither the calibrated score enters the verdict's single-signal side nor the plain loss the other
    assert row["base_calibrated"] == "ref_loss:neg_ratio" and row["base_calibrated.tpr"] == 0.8
    assert row["best_single"] == "ref_loss:neg_loss" and row["best_single.tpr"] == 0.6
    assert row["verdict"] == strength.INCONC and "base-calibrated TPR" in strength.markdown(
        strength.strength_table(Results(recs), "sc"), "sc"
    )
