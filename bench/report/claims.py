"""Each paper's headline claim, checked on the suite's measured records (never on reported numbers).

A check returns clauses, each with its own verdict. A leakage clause ("X leaks less than Y") takes the paired
difference of leakage (AUROC's distance from 0.5, or SSIM) on shared candidates and the claimed effect size (from
the paper's own table where it gives one, else a stated smallest effect of interest): ``holds`` when the 95%
interval lies below 0; ``contradicted`` when it lies above 0 (the opposite direction), or when the test is powered
for the claimed effect (minimum detectable effect, MDE = 2.8 x SE, at most the claimed effect) and the interval
excludes it; otherwise ``inconclusive`` (MDE above the claimed effect: both are printed). A utility clause holds
when the seed-paired interval of the utility loss lies within its stated tolerance and is contradicted when it lies
beyond it (``bench.report.clauses.utility_loss``), over every seed whose training runs the task's records of both
rows carry (utility belongs to the training run, whichever attack's cell recorded it); a row whose utility
collapsed never holds. A leakage clause measured in a view where the undefended baseline fails its positive control
(``bench.controls``: membership per task and view, reconstruction per attack) is ``inconclusive`` whatever its
interval says: a baseline that does not leak there leaves nothing to stop. The control gates the clauses of its own
view only, never a utility clause (a utility loss is measured whether or not anything leaks). Verdict of a claim
per scenario and preset: ``not measured`` (no records for its cells); ``contradicted`` if any clause is;
``inconclusive`` if any clause is and none contradicted; ``holds`` if all do; a DP claim whose composed epsilon
exceeds ``MEANINGFUL_EPSILON`` only ``holds only nominally``.

A membership claim is checked three times, side by side ([RMIA] issue): with the attacks of its paper (``paper:``
rows), with reference-model membership inference (``strongest:`` rows, ``STRONGEST``) and with the loss calibrated
against the base model (``base-calibrated:`` rows, ``CALIBRATED``: attacks/ref_loss.py, which matches or beats the
reference runs wherever the base model is a good reference; the attack-strength tables compare them): a defense that
stops only weak attacks is not a defense.
"""

from __future__ import annotations

from typing import Any, Callable

from .clauses import (
    CONTRA,
    DEFAULT_AUROC_EFFECT,
    DEFAULT_SSIM_EFFECT,
    FEDRAND_EFFECT,
    HOLDS,
    INCONC,
    MEANINGFUL_EPSILON,
    NEAR_CHANCE,
    NOT_MEASURED,
    SMP_LORA_EFFECT,
    _cells,
    control_failure,
    leakage_comparisons,
    main_utility,
    utility_loss,
)
from .results import Results

COLUMNS = ["paper", "claim", "scenario", "setting", "preset", "attacks", "verdict", "effect", "mde", "evidence"]
PAPERS_OWN = "the paper's"  # ``setting`` of a scenario of the kind the paper evaluated
CLAIMS: list[dict] = []
STRONGEST = ("rmia",)  # the re-check of every membership claim: offline RMIA (LiRA-offline is its variant)
CALIBRATED = ("ref_loss",)  # and with the loss calibrated against the base model (no reference training)


def strongest_only(res: Results) -> Results:
    """``res`` without the non-default configurations of the :data:`STRONGEST` and :data:`CALIBRATED` attacks (e.g.
    ``rmia(a=0.3)``): those passes check each attack as the suite configures it; controls stay those of every
    record."""
    rechecks = STRONGEST + CALIBRATED
    out = Results(r for r in res.records if r["attack"] not in rechecks or r.get("attack_label") == r["attack"])
    out._controls, out._recon_controls = res.controls(), res._recon_controls
    out.stale = res.stale
    return out


def claim(
    paper: str,
    scenarios: tuple[str, ...],
    text: str,
    *,
    attacks: tuple[str, ...] | None,
    evaluated: str,
    own: tuple[str, ...],
) -> Callable:
    """Register a check ``fn(res, scenario, preset, attacks)``; ``attacks``: the membership attacks of the
    paper's own evaluation (re-checked with ``STRONGEST``), None for a reconstruction claim (checked once);
    ``evaluated``: what the paper's experiments ran on; ``own``: the scenarios of that kind (the others are the
    suite's extension of the claim, labelled so a verdict there is not read as the paper's own result)."""
    if unknown := set(own) - set(scenarios):
        raise ValueError(f"claim {paper}: own scenarios {sorted(unknown)} are not among its scenarios {scenarios}")

    def deco(fn: Callable[[Results, str, str, tuple[str, ...]], list[dict]]) -> Callable:
        CLAIMS.append(
            {
                "paper": paper,
                "scenarios": scenarios,
                "claim": text,
                "check": fn,
                "attacks": attacks,
                "evaluated": evaluated,
                "own": own,
            }
        )
        return fn

    return deco


def setting(c: dict, scenario: str) -> str:
    """Whether ``scenario`` is of the kind claim ``c``'s paper evaluated, or the suite's extension of it."""
    return PAPERS_OWN if scenario in c["own"] else f"extension (the paper evaluated {c['evaluated']})"


def _passes(c: dict) -> list[tuple[str, tuple[str, ...]]]:
    """(label, attacks) of each check of claim ``c``: the paper's attacks, then for membership the reference-model
    and the base-calibrated attacks."""
    if c["attacks"] is None:
        return [("paper", ())]
    paper = ("paper: " + ", ".join(c["attacks"]), c["attacks"])
    return [
        paper,
        ("strongest: " + ", ".join(STRONGEST), STRONGEST),
        ("base-calibrated: " + ", ".join(CALIBRATED), CALIBRATED),
    ]


def verdict(clauses: list[dict]) -> str:
    """The claim's verdict from its clauses (module docstring)."""
    measured = [c for c in clauses if c["verdict"] != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED
    vs = {c["verdict"] for c in measured}
    if CONTRA in vs:
        return CONTRA
    if INCONC in vs:
        return INCONC
    if any(c.get("nominal") for c in measured):
        return "holds only nominally"
    return HOLDS


def evaluate(res: Results) -> list[dict]:
    """One row per claim x scenario x preset (``not measured`` rows where a scenario has no records)."""
    out = []
    strongest = strongest_only(res)
    for c in CLAIMS:
        for scenario, (which, attacks) in ((s, p) for s in c["scenarios"] for p in _passes(c)):
            presets = sorted({r["preset"] for r in res.records if r["scenario"] == scenario})
            for preset in presets or [""]:
                try:
                    on = strongest if attacks in (STRONGEST, CALIBRATED) else res
                    clauses = c["check"](on, scenario, preset, attacks) if preset else []
                except (KeyError, ValueError) as e:
                    clauses, note = [], f"could not evaluate: {type(e).__name__}: {e}"
                else:
                    note = ""
                v = verdict(clauses)
                evidence = "; ".join(x["text"] for x in clauses) or note or "no records of the cells this claim needs"
                effects = [cl for cl in clauses if "effect" in cl]
                out.append(
                    {
                        "paper": c["paper"],
                        "claim": c["claim"],
                        "scenario": scenario,
                        "setting": setting(c, scenario),
                        "preset": preset or "-",
                        "attacks": which,
                        "verdict": v,
                        "effect": "; ".join(sorted({f"{x['effect']:.3g}" for x in effects})),
                        "mde": "; ".join(f"{x['mde']:.3g}" for x in effects),
                        "evidence": evidence,
                    }
                )
    return out


def markdown(rows: list[dict], audits: list[dict] | None = None) -> str:
    """The claims page; ``audits`` (``bench.report.audit.dp_rows``) adds each DP row's claimed vs audited epsilon."""
    from tabulate import tabulate

    from .markdown import md_escape

    parts = [
        "# Claims from the papers, measured by the suite",
        "",
        "Verdicts come from the suite's own records and 95% intervals, per scenario and preset; reported "
        "numbers never enter them (see `reported_vs_measured.csv`). " + " ".join(__doc__.split("\n\n")[1].split()),
        "",
        "Whether the reference-model attack is the stronger one on each undefended baseline (the [RMIA] positive "
        "control: RMIA minus the best single-signal attack in TPR at the lowest FPR the non-members support, "
        "paired) is the attack-strength section of each scenario page and `<scenario>_attack_strength.csv`. "
        "Each membership claim has three rows, side by side: `paper: ...` checks it with the attacks of its paper, "
        "`strongest: rmia` with offline RMIA in its default configuration (offline a tuned per cell; another "
        "configuration, e.g. `rmia(a=0.3)`, stays in the tables only) and `base-calibrated: ref_loss` with the "
        "base model's loss minus the target's (Watson et al., ICLR 2022; no reference training, and as strong as "
        "RMIA or stronger wherever the base model is a good reference: see the attack-strength sections) on the "
        "same cells (a defense that stops only weak attacks is not a defense); `not measured` where those cells "
        "have not been run. "
        "`setting`: `the paper's` "
        "where the scenario is of the kind the paper's experiments ran on, `extension (...)` where the suite "
        "carries the claim to another kind of model or data (the verdict there is the suite's finding, not a test "
        "of the paper's own result; what the paper evaluated is named).",
        "",
    ]
    if rows:
        parts.append(
            tabulate(
                [[md_escape(r[c]) for c in COLUMNS] for r in rows],
                headers=COLUMNS,
                tablefmt="github",
                disable_numparse=True,
            )
        )
    if audits:
        cols = ["scenario", "preset", "task", "defense", "tightness", "attack", "delta", "one_run"]
        bad = [a for a in audits if a["violation"]]
        parts += ["", "## DP claims audited (claimed epsilon / empirical lower bound)", ""]
        parts += [
            f"> **DP VIOLATION: {md_escape(a['task'])} {md_escape(a['defense'])}: {md_escape(a['tightness'])}**"
            for a in bad
        ] + ([""] if bad else [])
        parts += [
            "The claim is the composed epsilon (without amplification where recorded); the bound is the "
            "strongest membership cell's (Jagielski et al., NeurIPS 2020; 95%, Bonferroni over thresholds and "
            "cells). A ratio near 1 is a tight claim; a large ratio means the attacks are far from the "
            "worst case the accounting covers (not that the claim is loose). `one_run`: the lower bound of "
            "Steinke et al. (NeurIPS 2023) from the same cells, each evaluation member paired at random with a "
            "non-member of its class (one pair = one independent coin; bench/one_run_audit.py), which needs no "
            "independence between one run's candidates; it also counts toward a VIOLATION.",
            "",
            tabulate(
                [[md_escape(a[c]) for c in cols] for a in audits],
                headers=cols,
                tablefmt="github",
                disable_numparse=True,
            ),
        ]
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------
# the claims


# [FLRSP] s.3.1 / 4.3: "two types of attacks that are effective against ViT and CNNs, respectively": APRIL on the ViT,
# the adversarial optimisation attack (inverting gradients) on ResNet34. Other pairs stay in the leaderboards.
FLRSP_ATTACK_OF = {"vit": "april", "resnet34": "inverting_gradients"}


def _flrsp_pair(task: str, attack: str) -> bool:
    return FLRSP_ATTACK_OF.get(task.rsplit("/", 1)[-1]) == attack


@claim(
    "papers/003 FLRSP",
    ("image-cls",),
    "FLRSP gives lower reconstruction SSIM than standard FL (FedSGD / FedAvg) at comparable accuracy (APRIL on the "
    "ViT, inverting gradients on ResNet34)",
    attacks=None,
    evaluated="ImageNet-pre-trained ViT-S/16 and ResNet34 classifiers on CIFAR-10",
    own=("image-cls",),
)
def flrsp_claim(res: Results, scenario: str, preset: str, attacks: tuple[str, ...]) -> list[dict]:
    labels = sorted(
        {
            r["defense_label"]
            for r in res.select(scenario=scenario, preset=preset, status=None)
            if r["defense"] == "flrsp"
        }
    )
    out = []
    for lab in labels:
        params = lab[lab.find("(") + 1 : -1].replace(",", ":") if "(" in lab else ""
        spec = "flrsp" + (":" + params if params else "")
        ref = "fedsgd" if "form=fedsgd" in lab else "fedavg"
        for c in leakage_comparisons(
            res,
            scenario,
            preset,
            spec,
            ref,
            views=("client_update",),
            kind="reconstruction",
            effect=DEFAULT_SSIM_EFFECT,
            pairs=_flrsp_pair,
        ):
            out.append({**c, "text": f"{lab}: {c['text']}"})
    return out


@claim(
    "papers/000 FedRand",
    ("llm-text", "vlm-caption"),
    "FedRand's reconstructed client models leak less to MaxRényi-K% membership inference than FedAvg's "
    "(client view) at comparable utility",
    attacks=("max_renyi",),
    evaluated="vision-language models (TinyLLaVA) on ScienceQA and MSCOCO captions",
    own=("vlm-caption",),
)
def fedrand_claim(res: Results, scenario: str, preset: str, attacks: tuple[str, ...]) -> list[dict]:
    return leakage_comparisons(
        res, scenario, preset, "fedrand", "fedavg", views=("client_model",), attacks=attacks, effect=FEDRAND_EFFECT
    )


def _near_chance(res: Results, task: str, alabel: str, view: str, recs: list[dict], metric: str) -> dict:
    e = res.metric(recs, metric)
    head = f"{task} {alabel}/{view}: smp_lora {metric}"
    if e is None:
        return {
            "verdict": NOT_MEASURED,
            "tasks": (task,),
            "text": f"{head} not measured"
            + (" (only the oracle-threshold ASR, which is optimistic, is recorded)" if metric == "asr_aux" else ""),
        }
    dist = abs(e.value - 0.5)
    far = e.has_ci() and min(abs(e.lo - 0.5), abs(e.hi - 0.5)) > NEAR_CHANCE and not e.lo <= 0.5 <= e.hi
    v = HOLDS if dist <= NEAR_CHANCE else (CONTRA if far else INCONC)
    gate = ""
    if v == HOLDS and (why := control_failure(res, recs[0]["preset"], task, view)) is not None:
        v, gate = INCONC, f"; {why}"  # near chance where the baseline does not leak either shows nothing
    return {
        "verdict": v,
        "tasks": (task,),
        "text": f"{head} {e.fmt()} (near 0.5 = within {NEAR_CHANCE}){gate} -> {v}",
    }


@claim(
    "papers/004 SMP-LoRA",
    ("ldm-t2i",),
    "SMP-LoRA brings membership ASR and AUC near 0.5 (less leakage than LoRA) with a smaller utility loss than MP-LoRA",
    attacks=("loss_mia", "gradient_mia"),  # [SMP-LoRA] s.4 / App. E (loss-based) and App. G (gradient-based)
    evaluated="LoRA adaptation of Stable Diffusion v1.5 on Pokemon and CelebA",
    own=("ldm-t2i",),
)
def smp_lora_claim(res: Results, scenario: str, preset: str, attacks: tuple[str, ...]) -> list[dict]:
    out = leakage_comparisons(
        res,
        scenario,
        preset,
        "smp_lora",
        "lora",
        views=("released_model",),
        attacks=attacks,
        util_rule="none",
        effect=SMP_LORA_EFFECT,
    )
    if not any(r["attack"] in attacks for r in res.select(scenario=scenario, preset=preset, defense="smp_lora")):
        return []  # nothing measured with these attacks
    for (task, alabel, view), recs in sorted(_cells(res, scenario, preset, "smp_lora", kind="membership").items()):
        if recs[0]["attack"] not in attacks:
            continue
        for metric in ("auroc", "asr_aux"):  # ASR calibrated on the attacker's data, never the oracle threshold
            out.append(_near_chance(res, task, alabel, view, recs, metric))
    smp = res.select(scenario=scenario, preset=preset, defense="smp_lora")
    mp = res.select(scenario=scenario, preset=preset, defense="mp_lora")
    if smp and mp:
        uk = main_utility(res, smp)
        for task in sorted({r["task"] for r in smp} & {r["task"] for r in mp}):
            mine, ref = [r for r in smp if r["task"] == task], [r for r in mp if r["task"] == task]
            us, um = res.utility(mine, uk), res.utility(ref, uk)
            if us is None or um is None:
                out.append({"verdict": NOT_MEASURED, "tasks": (task,), "text": f"{task} utility {uk} not measured"})
                continue
            loss = utility_loss(mine, ref, uk, relative=False)  # > 0: smp_lora worse than mp_lora, paired by seed
            if loss is None or not loss.has_ci():
                v, how = INCONC, " (one shared seed: no interval)"
            else:
                v = HOLDS if loss.hi < 0 else (CONTRA if loss.lo > 0 else INCONC)
                d = f"{loss.value:+.3g} [{loss.lo:+.3g}, {loss.hi:+.3g}]"
                how = f"; smp_lora's loss against mp_lora's (worse > 0) {d} over {loss.n_seeds} paired seeds"
            out.append(
                {
                    "verdict": v,
                    "tasks": (task,),
                    "text": f"{task} utility {uk}: smp_lora {us.fmt()} vs mp_lora {um.fmt()}{how} -> {v}",
                }
            )
    return out


def _epsilon(recs: list[dict], key: str) -> float | None:
    vals = sorted({float(v) for r in recs if (v := (r.get("privacy") or {}).get(key)) is not None})
    return vals[-1] if vals else None


@claim(
    "papers/002 DP-FedLoRA",
    ("llm-text",),
    "DP-FedLoRA gives a formal (epsilon, delta) guarantee and less membership leakage than FedAvg "
    "with a modest utility loss",
    attacks=("loss_mia", "max_renyi", "gradient_mia"),  # the paper runs none: the suite's single-signal attacks
    evaluated="federated LoRA fine-tuning of LLaMA-2-7B on Alpaca-GPT4 (it runs no membership attack)",
    own=("llm-text",),
)
def dp_fedlora_claim(res: Results, scenario: str, preset: str, attacks: tuple[str, ...]) -> list[dict]:
    recs = res.select(scenario=scenario, preset=preset, defense="dp_fedlora")
    leak = leakage_comparisons(
        res,
        scenario,
        preset,
        "dp_fedlora",
        "fedavg",
        views=("global_model", "client_model"),
        attacks=attacks,
        util_rule="modest",
        effect=DEFAULT_AUROC_EFFECT,
    )
    if not any(r["attack"] in attacks for r in recs):  # nothing measured with these attacks
        return []
    tasks = tuple(sorted({r["task"] for r in recs}))
    eps, comp = _epsilon(recs, "epsilon"), _epsilon(recs, "epsilon_composed")
    no_amp = _epsilon(recs, "epsilon_composed_no_amplification")
    judged = no_amp if no_amp is not None else comp
    if eps is None or judged is None:
        out: list[dict[str, Any]] = [
            {"verdict": CONTRA, "tasks": tasks, "text": "dp_fedlora records no (composed) epsilon"}
        ]
    else:
        meaningful = judged <= MEANINGFUL_EPSILON
        txt = (
            f"dp_fedlora epsilon per release {eps:.3g}, composed over all rounds {comp:.3g}"
            + (f", without sampling amplification {no_amp:.3g}" if no_amp is not None else "")
            + f": {'meaningful' if meaningful else 'only nominal'} (meaningful: composed <= {MEANINGFUL_EPSILON:g})"
        )
        out = [{"verdict": HOLDS, "nominal": not meaningful, "tasks": tasks, "text": txt}]
    return out + leak
