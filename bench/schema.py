"""The result record's typed schema (version 1, README "Result records"), checked on every read and write.

pydantic v2 models: numbers must be real numbers (a metric value "garbage" or NaN is rejected, not coerced),
names that become paths (scenario, cell_id) must be plain file names, artifact paths must be relative to the
output directory. Fields the harness adds beyond the documented ones (traceback, n_candidates, ...) pass.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
# Additive changes within schema 1 (new optional fields, relaxed requirements) bump the revision; a record carries
# the revision of the code that wrote it. Revision 2: reconstruction per_candidate without ``member``. Revision 3:
# membership per_candidate ``label`` (each candidate's class where the pools have classes; the one-run audit pairs
# within a class) and privacy ``epsilon_one_run_lower_bound``. Revision 4: reconstruction ``probe`` (how the intercepted
# updates were made, bench.recon_cells.PROBE_PROTOCOL). Revision 5: ``attack_resolved`` (the values an attack's
# configuration leaves to the task, e.g. the inversion budget, where they differ from those earlier records were made
# with).
# Revision 6: ``training`` (the SHA-256 prefix of the cached training run the cell scored, bench.training.identity).
# Revision 7: ``training.references`` (those of the reference runs a reference-model attack scored against).
# Revision 8: membership ``cost.signals_reused`` / ``signals_computed`` (the cell's signal calls served by the
# cell group's signal cache / computed: a cell with none computed cost only its scoring, bench.runplan).
# Revision 9: ``provenance.machine.isa`` (the instruction set torch's CPU kernels dispatch to, bench.machine.cpu_isa).
# Revision 10: ``cost.preparation_s`` (a cell's seconds in shared cache builds or waits, bench.cachefile.locked_s,
# left out of its ``attack_wall_s``).
# Revision 11: membership ``cost.signals_loaded`` (those of ``signals_reused`` read back from ``cache/signals``, e.g.
# by a cell resumed after a kill: its ``attack_wall_s`` covers only the passes it computed, bench.costs).
# Revision 12: a failed record's ``failure``: ``diverged`` (training under the defense produced non-finite values,
# bench.fl.TrainingDiverged: the defense's outcome at its budget, shown as `diverged`) or ``error``.
SCHEMA_REVISION = 12
FAILURES = ("diverged", "error")
STATUSES = ("ok", "n/a", "failed")
VIEWS = ("global_model", "client_model", "client_update", "released_model")

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# bench.store.jsonable writes a non-finite float as its string (e.g. epsilon "inf", perplexity "inf").
NonFinite = Literal["nan", "inf", "-inf"]
NonNegative = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
FileName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")]


class _Open(BaseModel):
    """Documented fields typed; further fields allowed (the harness may add diagnostics)."""

    model_config = ConfigDict(extra="allow", strict=True)


class Metric(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    value: Finite | None  # None = not reported, with the reason (e.g. TPR at an FPR the non-members cannot resolve)
    ci_low: Finite | None = None
    ci_high: Finite | None = None
    reason: StrictStr | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Metric:
        if self.value is None and not (self.reason or "").strip():
            raise ValueError("a metric without a value needs a reason")
        if self.ci_low is not None and self.ci_high is not None and self.ci_low > self.ci_high:
            raise ValueError(f"ci_low {self.ci_low} > ci_high {self.ci_high}")
        return self


class Roc(_Open):
    fpr: list[Finite]
    tpr: list[Finite]


class PerCandidate(_Open):
    """Membership: candidates' scores and ground truth. Reconstruction: targets' primary metric (``score``) and
    other metrics (``variants``) by target id, no ``member``."""

    score: list[Finite]
    member: list[Literal[0, 1]] | None = None
    variants: dict[str, list[Finite]] = {}
    id: list[StrictStr] | None = None
    label: list[StrictInt] | None = None  # membership, revision >= 3: the candidate's class, where the pools have one

    @model_validator(mode="after")
    def _lengths(self) -> PerCandidate:
        n = len(self.score)
        lengths = {f"variants.{k}": len(v) for k, v in self.variants.items()}
        for name in ("member", "id", "label"):
            if getattr(self, name) is not None:
                lengths[name] = len(getattr(self, name))
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(f"{len(self.score)} scores but lengths {bad}")
        return self


class Privacy(_Open):
    epsilon: NonNegative | Literal["inf"] | None = None
    epsilon_composed: NonNegative | Literal["inf"] | None = None
    delta: Annotated[float, Field(strict=True, gt=0, lt=1)] | None = None
    sample_rate: Annotated[float, Field(strict=True, gt=0, le=1)] | None = None
    note: StrictStr = ""


class Cost(_Open):
    bytes_up_per_round: NonNegative | None = None
    bytes_down_per_round: NonNegative | None = None
    params_up_per_round: NonNegative | None = None
    rounds: Annotated[int, Field(strict=True, ge=0)] | None = None
    train_wall_s: NonNegative | None = None
    attack_wall_s: NonNegative | None = None
    peak_mem_mb: NonNegative | None = None
    signals_reused: Annotated[int, Field(strict=True, ge=0)] | None = None  # revision 8
    signals_computed: Annotated[int, Field(strict=True, ge=0)] | None = None  # revision 8
    preparation_s: NonNegative | None = None  # revision 10
    signals_loaded: Annotated[int, Field(strict=True, ge=0)] | None = None  # revision 11


class Provenance(_Open):
    code_version: StrictStr
    config_hash: StrictStr
    started_at: Annotated[str, Field(strict=True, pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")] | None = None


class Training(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    sha256: Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{16}$")]
    references: list[Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{16}$")]] | None = None  # revision 7


class Record(_Open):
    schema_version: Literal[1]
    schema_revision: StrictInt | None = None  # None: written before revisions were recorded
    cell_id: FileName
    scenario: FileName
    task: StrictStr
    preset: StrictStr
    seed: Annotated[int, Field(strict=True, ge=0)]
    defense: StrictStr
    defense_params: dict[str, Any]
    defense_label: StrictStr
    attack: StrictStr
    attack_params: dict[str, Any]
    attack_label: StrictStr
    attack_kind: Literal["membership", "reconstruction"]
    view: Literal[VIEWS]  # type: ignore[valid-type]
    status: Literal[STATUSES]  # type: ignore[valid-type]
    reason: StrictStr | None = None
    failure: Literal[FAILURES] | None = None  # type: ignore[valid-type]  # of a failed record (revision 12)
    metrics: dict[str, Metric] = {}
    variants: dict[str, dict[str, Finite]] = {}
    roc: Roc | None = None
    primary: StrictStr | None = None
    per_sample: dict[str, list[Finite]] = {}
    per_candidate: PerCandidate | None = None
    n_candidates: StrictInt | None = None
    attack_details: dict[str, Any] | None = None  # what the attack states about its scoring (e.g. slice token counts)
    utility: dict[str, Finite | NonFinite | None] = {}
    training: Training | None = None  # the cached training run the cell scored (revision 6)
    privacy: Privacy = Privacy()
    cost: Cost = Cost()
    artifacts: dict[str, StrictStr] = {}
    provenance: Provenance

    @field_validator("artifacts")
    @classmethod
    def _relative(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            p = PurePosixPath(path)
            if p.is_absolute() or ".." in p.parts or not path:
                raise ValueError(f"artifact {name!r} path {path!r} must be relative to the output directory")
        return v

    @model_validator(mode="after")
    def _by_status(self) -> Record:
        if self.status != "ok" and not (self.reason or "").strip():
            raise ValueError(f"status {self.status!r} needs a reason")
        if self.failure is not None and self.status != "failed":
            raise ValueError(
                f"failure {self.failure!r} on a record of status {self.status!r} (only a failed one has it)"
            )
        if self.status == "ok":
            if not self.metrics:
                raise ValueError("status 'ok' needs metrics")
            if self.attack_kind == "membership" and (self.per_candidate is None or self.per_candidate.member is None):
                raise ValueError("an ok membership record needs per_candidate with member")
        return self


def problems(err: ValidationError, *, limit: int = 4) -> str:
    """A one-line summary of a validation error: ``field.path: message (got value)``, the first few."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(x) for x in e["loc"]) or "record"
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r:.60})"
        parts.append(f"{loc}: {e['msg']}{shown}")
    more = err.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def newer_writer(record: Any) -> str | None:
    """Why ``record`` comes from a newer version of the suite than this code (None if it does not): such a
    record may be valid for its writer, so a reader that cannot read it leaves it in place."""
    if not isinstance(record, dict):
        return None
    v, r = record.get("schema_version"), record.get("schema_revision")
    if isinstance(v, int) and not isinstance(v, bool) and v > SCHEMA_VERSION:
        return f"schema_version {v} (this code reads {SCHEMA_VERSION})"
    if v == SCHEMA_VERSION and isinstance(r, int) and not isinstance(r, bool) and r > SCHEMA_REVISION:
        return f"schema revision {r} (this code knows up to {SCHEMA_REVISION})"
    return None


def validate(record: Any) -> str | None:
    """None when ``record`` is a valid schema-1 record, else what is wrong with it (one line)."""
    if not isinstance(record, dict):
        return f"a record is a JSON object, got {type(record).__name__}"
    if record.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {record.get('schema_version')!r}, this code reads {SCHEMA_VERSION}"
    try:
        Record.model_validate(record)
    except ValidationError as e:
        return problems(e)
    return None
