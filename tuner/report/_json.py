"""The JSON report (schema ``dynspec-report/1``, documented in docs/commands.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from tuner.protocol import band_table_to_json
from tuner.report._model import REPORT_SCHEMA, Report, ServerReport, VersionEntry


# --- JSON ---------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _table_json(table: Sequence[tuple[int | None, int]]) -> list[list[int | None]]:
    return [[b, k] for b, k in table]


def _version_json(v: VersionEntry) -> dict[str, Any]:
    out = {
        "ts": _f(v.ts, 3),
        "version": v.version,
        "table": _table_json(v.table),
        "policy": v.policy,
        "reason": v.reason,
        "outcome": v.outcome,
    }
    if v.bands is not None:  # only a banded table: [bound, k_unknown, k1..k4] per row
        out["bands"] = band_table_to_json(v.bands)
    return out


def report_to_json(report: Report) -> dict[str, Any]:
    """The report as plain JSON-able data, schema ``dynspec-report/1`` (docs/commands.md: ``report``).

    Keys never disappear: a value that is unknown is ``null``. New keys may be added
    within the same schema version; a change of meaning bumps it.
    """
    return {
        "schema": REPORT_SCHEMA,
        "generated_at": _f(report.generated_at, 3),
        "database": report.database,
        "window": {"since": _f(report.since, 3), "until": _f(report.until, 3)},
        "bucket_edges": list(report.bucket_edges),
        "servers": [_server_json(s) for s in report.servers],
    }


def _server_json(s: ServerReport) -> dict[str, Any]:
    return {
        "server": s.server,
        "model": s.model,
        "arms": list(s.arms),
        "always_arm": s.always_arm,
        "observations": s.observations,
        "decode_steps": s.decode_steps,
        "data_span": None if s.data_span is None else [_f(s.data_span[0], 3),
                                                         _f(s.data_span[1], 3)],
        "table": None if s.table is None else _version_json(s.table),
        "chosen_from": s.chosen_from,
        "metrics_only": s.metrics_only,
        "crossover_b": s.crossover_b,
        "counts": dict(s.counts),
        "gains": _gains_json(s),
        "switchback": s.switchback.as_dict() if s.switchback is not None else None,
        "buckets": [
            {
                "bucket": bk.index,
                "label": bk.label,
                "low": bk.low,
                "high": bk.high,
                "b_ref": _f(bk.b_ref, 3),
                "chosen": bk.chosen,
                "best": bk.best,
                "gain_vs_k0": _f(bk.gain_vs_off),
                "gain_vs_always": _f(bk.gain_vs_always),
                "arms": [
                    {
                        "arm": a.arm,
                        "goodput": _f(a.goodput, 3),
                        "ci95": None if a.ci_low is None else [_f(a.ci_low, 3),
                                                               _f(a.ci_high, 3)],
                        "decode_steps": a.decode_steps,
                        "intervals": a.intervals,
                        "busy_s": _f(a.busy_s, 6),
                        "emitted_tokens": a.emitted_tokens,
                        "raw_goodput": _f(a.raw_goodput, 3),
                        "mean_b": _f(a.mean_b, 3),
                        "accepted_per_step": _f(a.accepted_per_step),
                        "acceptance_rate": _f(a.acceptance_rate),
                    }
                    for a in bk.arms
                ],
            }
            for bk in s.buckets
        ],
        "goodput_by_batch_size": [
            {"b": p.b, "k": p.k, "goodput": _f(p.goodput, 3), "decode_steps": p.decode_steps}
            for p in s.curve
        ],
        "timeline": {
            "bin_s": _f(s.bin_s, 3),
            "points": [
                {"t": _f(p.t, 3), "k": p.k, "goodput": _f(p.goodput, 3),
                 "decode_steps": p.decode_steps}
                for p in s.timeline
            ],
        },
        "versions": [_version_json(v) for v in s.versions],
        "events": [{"ts": _f(e.ts, 3), "kind": e.kind, "detail": e.detail} for e in s.events],
        "plots": dict(s.plots),
    }


def _gains_json(s: ServerReport) -> list[dict[str, Any]]:
    from tuner.report_gain import gains_json

    return gains_json(s.gains)


def render_json(report: Report) -> str:
    return json.dumps(report_to_json(report), indent=2, sort_keys=False) + "\n"
