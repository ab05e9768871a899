"""`RunResult`: what a run decided and measured, the one type behind results.json.

A run builds it (`headlab.runs`), the CLI prints its summary, the report renders it and
`headlab.viz` builds a small one for a single text. ``to_json`` writes the results.json
schema (see reports/README.md); ``from_json`` reads it back, including files written
before the schema carried a version, and fills whatever is absent or malformed with None
so that a partial file still renders. Only model, method, importance and heads_total
are required.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from headlab.analysis import HeadClusters
from headlab.errors import UserError
from headlab.evaluate.cache import KVCacheReport
from headlab.evaluate.needle import NeedleResult
from headlab.recovery import RecoveryReport
from headlab.schedule import CurvePoint, RemovalScores

# 2: this module's types; 1: results.json of the same keys, written before it had a version
SCHEMA_VERSION = 2
REQUIRED = ("model", "method", "importance", "heads_total")

T = TypeVar("T")


@dataclass
class BeforeAfter(Generic[T]):
    """One figure of the model as it came (``before``) and of the model you get."""

    before: T | None = None
    after: T | None = None


@dataclass
class QualityFigures(BeforeAfter[float]):
    """Held-out quality in the objective's metric, and the loss: ``before`` the model
    as it came, ``after`` the model you get, ``pruned`` after pruning and before
    recovery (None when no recovery ran: then ``after`` is the pruned model)."""

    metric: str | None = None
    higher_is_better: bool | None = None
    loss_before: float | None = None
    loss_after: float | None = None
    pruned: float | None = None
    loss_pruned: float | None = None


@dataclass
class LengthLatency(BeforeAfter[float]):
    """Median forward times (ms) of the unpruned and the pruned model on ``batch`` x
    ``seq_len`` tokens, and the drop in time their FLOPs predict
    (`headlab.models.flops.count_flops`: projections, S^2 attention terms, MLP)."""

    batch: int | None = None
    seq_len: int | None = None
    predicted_drop: float | None = None


@dataclass
class Latency(BeforeAfter[float]):
    """Median forward times (ms) of the unpruned and the pruned model on one input of
    ``batch`` x ``seq_len`` tokens; ``by_length`` the same at each length measured, that
    one and a longer one where attention's S^2 terms weigh (head pruning pays there)."""

    batch: int | None = None
    seq_len: int | None = None
    by_length: list[LengthLatency] = field(default_factory=list)
    # cores' worth of CPU other processes used when timed: above half a core, noisy
    others_load: float | None = None


@dataclass
class DataSummary:
    """Where the tokens came from and how many scored and measured the model."""

    spec: str | None = None
    scoring_tokens: int | None = None
    heldout_tokens: int | None = None
    scoring_examples: int | None = None
    heldout_examples: int | None = None
    seq_len: int | None = None
    warning: str | None = None
    # the evaluation source when named apart (--eval-data), the protocol that measures
    # (split | windows, headlab.data.protocol) and how the two sets are kept apart
    eval_spec: str | None = None
    eval_protocol: str | None = None
    eval_seq_len: int | None = None
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    separation: str | None = None


@dataclass
class Sample:
    """One held-out text's attention on the unpruned model, for the report's views.

    ``attention`` is the 8-bit encoding of `headlab.report.encode_attention` of an
    (L, H0, S, S) array; ``tokens`` are the S tokens as a reader would write them."""

    text: str | None
    tokens: list[str]
    attention: dict[str, Any]


@dataclass
class RunResult:
    """Everything results.json holds. ``importance`` is layers x original heads (NaN:
    not scored); ``kept_heads`` maps layer -> original head indices kept (None for a
    score-only run); ``curve`` is the run's pruning curve, ``curves`` one per method
    drawn (the run's own included)."""

    model: str
    method: str
    importance: list[list[float]]
    heads_total: int
    family: str | None = None
    kind: str | None = None
    schedule: str | None = None
    keep: float | None = None
    data: DataSummary = field(default_factory=DataSummary)
    heads_kept: int | None = None
    kept_heads: dict[int, list[int]] | None = None
    importance_normalisation: str | None = None
    scoring_details: dict[str, Any] = field(default_factory=dict)  # e.g. where gates ended
    # a pruning run's scores that chose each removal (``importance`` is the first scoring)
    removal_scores: RemovalScores | None = None
    heads_per_layer: BeforeAfter[list[int]] = field(default_factory=BeforeAfter)
    kv_heads_per_layer: BeforeAfter[list[int]] = field(default_factory=BeforeAfter)
    quality: QualityFigures = field(default_factory=QualityFigures)
    curve: list[CurvePoint] = field(default_factory=list)
    curves: dict[str, list[CurvePoint]] = field(default_factory=dict)
    params: BeforeAfter[int] = field(default_factory=BeforeAfter)
    latency_ms: Latency | None = None
    kv_cache_bytes_per_token: BeforeAfter[int] = field(default_factory=BeforeAfter)
    kv_cache: KVCacheReport | None = None  # unit, demotion, bytes at lengths, decode speed
    export: str | None = None
    recovery: RecoveryReport | None = None
    sample: Sample | None = None
    statistics: list[dict[str, Any]] = field(default_factory=list)
    clusters: HeadClusters | None = None
    # detector scores of the unpruned model by kind (headlab.detectors), layers x heads
    head_types: dict[str, list[list[float]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    created: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    status: str | None = None
    schema_version: int = SCHEMA_VERSION
    # lm-eval tasks: name -> metrics exactly as lm-eval's results reports them, before
    # and after; the needle test's accuracy grid before and after (headlab.evaluate.needle)
    tasks: dict[str, BeforeAfter[dict[str, Any]]] = field(default_factory=dict)
    needle: BeforeAfter[NeedleResult] | None = None

    @property
    def score_only(self) -> bool:
        """True for a run that scored heads and removed none."""
        return self.kept_heads is None

    def to_json(self) -> dict[str, Any]:
        """The results.json dict: plain JSON values, NaN and inf as null."""
        d = {
            "schema_version": self.schema_version,
            "model": self.model, "family": self.family, "kind": self.kind,
            "method": self.method, "schedule": self.schedule, "keep": self.keep,
            "data": asdict(self.data),
            "heads_total": self.heads_total, "heads_kept": self.heads_kept,
            "kept_heads": None if self.kept_heads is None
            else {str(k): list(v) for k, v in self.kept_heads.items()},
            "importance": self.importance,
            "importance_normalisation": self.importance_normalisation,
            "heads_per_layer": asdict(self.heads_per_layer),
            "kv_heads_per_layer": asdict(self.kv_heads_per_layer),
            "quality": asdict(self.quality),
            "curve": [p.to_json() for p in self.curve],
            "curves": {m: [p.to_json() for p in c] for m, c in self.curves.items()},
            "params": asdict(self.params),
            "latency_ms": None if self.latency_ms is None else asdict(self.latency_ms),
            "kv_cache_bytes_per_token": asdict(self.kv_cache_bytes_per_token),
            "kv_cache": None if self.kv_cache is None else self.kv_cache.to_json(),
            "export": self.export,
            "recovery": None if self.recovery is None else self.recovery.to_json(),
            "sample": None if self.sample is None else asdict(self.sample),
            "statistics": self.statistics,
            "clusters": None if self.clusters is None else self.clusters.to_json(),
            "config": self.config, "created": self.created, "versions": self.versions,
            "files": self.files, "status": self.status,
            "tasks": {name: asdict(ba) for name, ba in self.tasks.items()},
            "needle": None if self.needle is None else {
                side: None if r is None else r.to_json()
                for side, r in (("before", self.needle.before), ("after", self.needle.after))},
        }
        # optional: a file without them reads back as it was
        if self.head_types:
            d["head_types"] = self.head_types
        if self.scoring_details:
            d["scoring_details"] = self.scoring_details
        if self.removal_scores is not None:
            d["removal_scores"] = self.removal_scores.to_json()
        return _json_safe(d)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunResult:
        """Read a results.json dict; absent, null or malformed optional parts become
        None (or empty), so any results.json headlab ever wrote still renders."""
        if not isinstance(d, dict):
            raise UserError(f"results must be a JSON object, got {type(d).__name__}")
        missing = [k for k in REQUIRED if d.get(k) is None]
        if missing:
            raise UserError(f"results lack {', '.join(missing)}; a report needs at least "
                            f"{', '.join(REQUIRED)} (see reports/README.md)")
        importance = d["importance"]
        if not isinstance(importance, list) or not all(isinstance(r, list) for r in importance):
            raise UserError("results['importance'] must be a list of per-layer lists of "
                            f"floats (layers x heads); got {type(importance).__name__}")
        _check_schema(d)
        data, quality = _section(d, "data"), _section(d, "quality")
        latency = d.get("latency_ms")
        return cls(
            model=str(d["model"]), method=str(d["method"]),
            importance=[[_float(v, math.nan) for v in row] for row in importance],
            heads_total=int(d["heads_total"]),
            family=_str(d.get("family")), kind=_str(d.get("kind")),
            schedule=_str(d.get("schedule")), keep=_float(d.get("keep")),
            data=DataSummary(
                spec=_str(data.get("spec")), scoring_tokens=_int(data.get("scoring_tokens")),
                heldout_tokens=_int(data.get("heldout_tokens")),
                scoring_examples=_int(data.get("scoring_examples")),
                heldout_examples=_int(data.get("heldout_examples")),
                seq_len=_int(data.get("seq_len")), warning=_str(data.get("warning")),
                eval_spec=_str(data.get("eval_spec")),
                eval_protocol=_str(data.get("eval_protocol")),
                eval_seq_len=_int(data.get("eval_seq_len")),
                calib_samples=_int(data.get("calib_samples")),
                calib_seq_len=_int(data.get("calib_seq_len")),
                separation=_str(data.get("separation"))),
            heads_kept=_int(d.get("heads_kept")),
            kept_heads=_kept(d.get("kept_heads")),
            importance_normalisation=_str(d.get("importance_normalisation")),
            scoring_details=_section(d, "scoring_details"),
            removal_scores=_removal(d.get("removal_scores")),
            heads_per_layer=_counts(d.get("heads_per_layer")),
            kv_heads_per_layer=_counts(d.get("kv_heads_per_layer")),
            quality=QualityFigures(
                metric=_str(quality.get("metric")),
                higher_is_better=quality.get("higher_is_better")
                if isinstance(quality.get("higher_is_better"), bool) else None,
                before=_float(quality.get("before")), after=_float(quality.get("after")),
                loss_before=_float(quality.get("loss_before")),
                loss_after=_float(quality.get("loss_after")),
                pruned=_float(quality.get("pruned")),
                loss_pruned=_float(quality.get("loss_pruned"))),
            curve=_curve(d.get("curve")),
            curves={str(m): _curve(c) for m, c in _section(d, "curves").items()},
            params=BeforeAfter(_int(_section(d, "params").get("before")),
                               _int(_section(d, "params").get("after"))),
            latency_ms=None if not isinstance(latency, dict) else Latency(
                _float(latency.get("before")), _float(latency.get("after")),
                _int(latency.get("batch")), _int(latency.get("seq_len")),
                [LengthLatency(_float(x.get("before")), _float(x.get("after")),
                               _int(x.get("batch")), _int(x.get("seq_len")),
                               _float(x.get("predicted_drop")))
                 for x in latency.get("by_length") or [] if isinstance(x, dict)],
                _float(latency.get("others_load"))),
            kv_cache_bytes_per_token=BeforeAfter(
                _int(_section(d, "kv_cache_bytes_per_token").get("before")),
                _int(_section(d, "kv_cache_bytes_per_token").get("after"))),
            kv_cache=KVCacheReport.from_json(d.get("kv_cache")),
            export=_str(d.get("export")),
            recovery=_recovery(d.get("recovery")),
            sample=_sample(d.get("sample")),
            statistics=[r for r in d.get("statistics") or [] if isinstance(r, dict)]
            if isinstance(d.get("statistics"), list) else [],
            clusters=_clusters(d.get("clusters")),
            head_types=_head_types(d.get("head_types")),
            config=_section(d, "config"), created=_str(d.get("created")),
            versions={str(k): str(v) for k, v in _section(d, "versions").items()},
            files={str(k): v for k, v in _section(d, "files").items() if isinstance(v, str)},
            status=_str(d.get("status")),
            schema_version=_int(d.get("schema_version")) or 1,
            tasks=_tasks(d.get("tasks")),
            needle=_needle(d.get("needle")),
        )


def _check_schema(d: dict[str, Any]) -> None:
    """What a reader cannot make sense of is refused naming the key: a schema version
    newer than this headlab reads, a head's importance or head count that is no number
    (a malformed optional section reads as not measured)."""
    version = d.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not (
            1 <= version <= SCHEMA_VERSION):
        raise UserError(f"results['schema_version'] is {version!r}; this headlab reads "
                        f"versions 1 to {SCHEMA_VERSION}: upgrade headlab or rerun the run")
    for layer, row in enumerate(d["importance"]):
        # null or NaN: not scored; anything but a number is a broken file
        bad = next((v for v in row if v is not None and (
            isinstance(v, bool) or not isinstance(v, int | float))), None)
        if bad is not None:
            raise UserError(f"results['importance'] layer {layer} holds {bad!r}, not a number")
    if not isinstance(d["heads_total"], int) or isinstance(d["heads_total"], bool):
        raise UserError(f"results['heads_total'] must be a whole number, got "
                        f"{d['heads_total']!r}")


def _head_types(x: Any) -> dict[str, list[list[float]]]:
    """Detector maps by kind; a malformed kind is dropped, null scores are NaN."""
    if not isinstance(x, dict):
        return {}
    return {str(k): [[_float(v, math.nan) for v in row] for row in grid]
            for k, grid in x.items()
            if isinstance(grid, list) and all(isinstance(r, list) for r in grid)}


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _section(d: dict, key: str) -> dict:
    """d[key] when it is a dict, else an empty one: a null or malformed part is absent."""
    value = d.get(key)
    return value if isinstance(value, dict) else {}


def _float(x: Any, default: float | None = None) -> float | None:
    if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return default


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int | float) and not isinstance(x, bool) \
        and math.isfinite(x) else None


def _str(x: Any) -> str | None:
    return None if x is None else str(x)


def _kept(x: Any) -> dict[int, list[int]] | None:
    """kept_heads: {layer: original indices}; JSON keys are strings."""
    if not isinstance(x, dict):
        return None
    kept = {}
    for layer, heads in x.items():
        try:
            kept[int(layer)] = [int(h) for h in heads] if isinstance(heads, list) else []
        except (TypeError, ValueError):
            continue
    return kept


def _counts(x: Any) -> BeforeAfter[list[int]]:
    d = x if isinstance(x, dict) else {}

    def side(v: Any) -> list[int] | None:
        return [int(n) for n in v] if isinstance(v, list) and all(
            isinstance(n, int) for n in v) else None

    return BeforeAfter(side(d.get("before")), side(d.get("after")))


def _curve(x: Any) -> list[CurvePoint]:
    if not isinstance(x, list):
        return []
    points = []
    for p in x:
        if not isinstance(p, dict) or _float(p.get("fraction_pruned")) is None:
            continue
        points.append(CurvePoint(fraction_pruned=_float(p.get("fraction_pruned")),
                                 quality=_float(p.get("quality")), loss=_float(p.get("loss")),
                                 heads_kept=_int(p.get("heads_kept"))))
    return points


def _sample(x: Any) -> Sample | None:
    if not isinstance(x, dict) or not isinstance(x.get("tokens"), list) \
            or not isinstance(x.get("attention"), dict):
        return None
    return Sample(_str(x.get("text")), [str(t) for t in x["tokens"]], x["attention"])


def _removal(x: Any) -> RemovalScores | None:
    if not isinstance(x, dict):
        return None
    try:
        return RemovalScores.from_json(x)
    except (KeyError, TypeError, ValueError):
        return None


def _recovery(x: Any) -> RecoveryReport | None:
    if not isinstance(x, dict):
        return None
    try:
        return RecoveryReport.from_json(x)
    except (KeyError, TypeError, ValueError):
        return None


def _clusters(x: Any) -> HeadClusters | None:
    if not isinstance(x, dict):
        return None
    try:
        return HeadClusters.from_json(x)
    except (KeyError, TypeError, ValueError):
        return None


def _tasks(x: Any) -> dict[str, BeforeAfter[dict[str, Any]]]:
    """tasks: {name: {"before": metrics, "after": metrics}}; malformed entries dropped."""
    if not isinstance(x, dict):
        return {}
    out = {}
    for name, ba in x.items():
        if isinstance(ba, dict):
            sides = [ba.get(k) if isinstance(ba.get(k), dict) else None
                     for k in ("before", "after")]
            out[str(name)] = BeforeAfter(*sides)
    return out


def _needle(x: Any) -> BeforeAfter[NeedleResult] | None:
    if not isinstance(x, dict):
        return None

    def side(v: Any) -> NeedleResult | None:
        try:
            return NeedleResult.from_json(v) if isinstance(v, dict) else None
        except (KeyError, TypeError, ValueError):
            return None

    result = BeforeAfter(side(x.get("before")), side(x.get("after")))
    return None if result.before is None and result.after is None else result
