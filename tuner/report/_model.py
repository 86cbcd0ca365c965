"""The report model: frozen records of what a report says, and its constants."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_TIME_BINS",
    "FORMATS",
    "REPORT_EVENT_KINDS",
    "REPORT_SCHEMA",
    "TEXT_WIDTH",
    "ArmStat",
    "BucketReport",
    "CurvePoint",
    "EventEntry",
    "Report",
    "ServerReport",
    "TimePoint",
    "VersionEntry",
]

REPORT_SCHEMA = "dynspec-report/1"
FORMATS = ("text", "json", "html")
TEXT_WIDTH = 100
# Goodput-over-time resolution: enough points for a readable line, few enough groups for
# the database to return in milliseconds.
DEFAULT_TIME_BINS = 48
# Events a report lists (others stay in the database).
REPORT_EVENT_KINDS = (
    "outage",
    "recovered",
    "restart",
    "update_rejected",
    "plugin_missing",
    "malformed_reply",
    "arms_changed",
    "model_changed",
)

# Two-sided 95 % Student t quantiles for 1..30 degrees of freedom; 1.96 beyond.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def _t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96

# --- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArmStat:
    """One arm in one bucket over the report window."""

    arm: int
    goodput: float  # tokens/s at the bucket's b_ref
    ci_low: float | None  # 95 % interval; None with fewer than 2 intervals
    ci_high: float | None
    decode_steps: int
    intervals: int  # stored observations (sampling intervals)
    busy_s: float
    emitted_tokens: int
    raw_goodput: float  # Σ emitted / Σ busy, no batch-size standardisation
    mean_b: float  # step-weighted mean batch size this arm was seen at
    accepted_per_step: float | None  # accepted drafts per request per decode step
    acceptance_rate: float | None  # accepted / drafted tokens


@dataclass(frozen=True, slots=True)
class BucketReport:
    index: int
    label: str
    low: int
    high: int | None
    b_ref: float
    arms: tuple[ArmStat, ...]
    chosen: int | None  # the arm of the table in effect (or ``best`` without one)
    best: int | None  # highest estimated goodput in the window
    gain_vs_off: float | None  # goodput(chosen) / goodput(k=0) - 1
    gain_vs_always: float | None  # goodput(chosen) / goodput(always arm) - 1

    def arm(self, k: int | None) -> ArmStat | None:
        return next((a for a in self.arms if a.arm == k), None)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    b: int
    k: int
    goodput: float
    decode_steps: int


@dataclass(frozen=True, slots=True)
class TimePoint:
    t: float  # bin start
    k: int | None  # None: all arms together
    goodput: float
    decode_steps: int


@dataclass(frozen=True, slots=True)
class VersionEntry:
    ts: float
    version: int
    table: tuple[tuple[int | None, int], ...]
    policy: str
    reason: str
    outcome: str
    # A protocol v2 table whose bands differ: (bound, (k of the unknown band, k of bands
    # 1..)) per row; ``table`` is then its band-agnostic view (the unknown band's k).
    bands: tuple[tuple[int | None, tuple[int, ...]], ...] | None = None


@dataclass(frozen=True, slots=True)
class EventEntry:
    ts: float
    kind: str
    detail: str


@dataclass(frozen=True)
class ServerReport:
    server: str
    arms: tuple[int, ...]
    always_arm: int | None
    observations: int
    decode_steps: int
    data_span: tuple[float, float] | None
    table: VersionEntry | None  # the table in effect at the end of the window
    chosen_from: str  # "policy" (the table above) or "data" (best per bucket)
    crossover_b: int | None  # speculation is off from this batch size up
    buckets: tuple[BucketReport, ...]
    curve: tuple[CurvePoint, ...]
    timeline: tuple[TimePoint, ...]
    bin_s: float | None
    versions: tuple[VersionEntry, ...]
    events: tuple[EventEntry, ...]
    counts: dict[str, int]
    metrics_only: bool = False  # watched without the plugin (coarse /metrics observations)
    model: str | None = None  # what the server last said it runs
    plots: dict[str, str] = field(default_factory=dict)  # name -> file, when written beside
    gains: tuple = ()  # tuner.report_gain.ReportGain per baseline (start, k0, always)
    switchback: object = None  # tuner.switchback.SwitchbackGain (run --holdout), else None


@dataclass(frozen=True)
class Report:
    generated_at: float
    database: str
    since: float | None
    until: float | None
    bucket_edges: tuple[int, ...]
    servers: tuple[ServerReport, ...]
