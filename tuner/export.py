"""Export the learned table: SGLang's own adaptive config, or our versioned policy file.

Where the table comes from (``source``):

- ``policy``: the last table recorded for the server in the history (the last one the server
  *applied*; with only dry runs recorded, the last dry-run decision);
- ``data``: re-derived now, greedily per bucket, from the stored observations in the window
  (the arm with the highest estimated goodput among arms with at least
  ``DEFAULT_MIN_INTERVALS`` sampling intervals, as ``dynspec-tuner report`` shows it). A bucket
  without such data between measured ones takes the arm of the nearest measured bucket (the
  lower one on a tie); every bucket above the largest measured one keeps that bucket's arm
  (the table stops at the largest measured batch size). Both are listed, in a warning and in
  the file's notes, as is a bucket whose choice its 95 % intervals do not separate;
- ``auto`` (default): ``policy`` when a table was recorded, else ``data`` (a server watched in
  metrics-only mode never had a table pushed).

``sglang-adaptive`` writes the JSON that SGLang 0.5.23 reads with ``--speculative-adaptive
--speculative-adaptive-config FILE``: one batch-size slot per table row, keyed by the row's
lower bound (``str(previous max + 1)``, the first ``"1"``), each with a single candidate step,
``{"candidate_steps": [k]}``. With one candidate a slot's EMA has nothing to move to, so stock
SGLang follows the table exactly. Two facts of SGLang shape what the file means:

- SGLang pre-builds one runtime state (CUDA graphs, memory) per step in the **union** of all
  slots' candidate steps and sizes its buffers for the largest; those arms, and only those,
  must be built (listed in the file under ``"_dynspec"``, whose keys SGLang ignores), and a
  ``--speculative-num-steps`` given on the command line must be one of them.
- Slots are chosen **after CUDA-graph padding**: a batch of ``b`` runs in the next captured
  size, and that size picks the slot. The mapping is exact when every row's upper bound is a
  captured batch size (the tuner's default bucket edges all are); otherwise :func:`export`
  reports which batch sizes would land in the next slot.

``dynspec`` writes our own policy file through :mod:`tuner.policyfile` (protocol v1 table plus
provenance), which the plugin loads at server start.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies import Buckets, table_from_arms
from tuner._atomic import write_atomic
from tuner.errors import ConfigError
from tuner.protocol import BandTable, ProtocolError, Table, format_table, validate_table
from tuner.report import BucketReport, ServerReport, build_report
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size

if TYPE_CHECKING:
    from storage import Storage

__all__ = [
    "DEFAULT_MIN_INTERVALS",
    "EXPORT_FORMATS",
    "SGLANG_ADAPTIVE_FORMAT",
    "SOURCES",
    "ExportResult",
    "LearnedTable",
    "export",
    "learned_table",
    "load_sglang_adaptive",
    "padding_crossings",
    "sglang_adaptive_config",
    "table_from_buckets",
]

EXPORT_FORMATS = ("sglang-adaptive", "dynspec")
SOURCES = ("auto", "policy", "data")
# An arm needs this many sampling intervals in a bucket to be chosen from data: a handful of
# intervals gives an interval too wide to stand against an arm measured a hundred times.
DEFAULT_MIN_INTERVALS = 5
# Said where the data source's arms ran under banded tables (protocol v2).
BANDED_DATA_NOTE = ("the server ran banded tables: each arm's goodput in the data is over the "
                    "acceptance bands that chose it, so the best arm by the data may not be "
                    "the best on all traffic (--source policy exports the table it ran)")
# Marks our files; SGLang ignores non-digit top-level keys except as slot defaults, and a
# slot reads only the fields it knows.
SGLANG_ADAPTIVE_FORMAT = "dynspec-sglang-adaptive/1"
_META_KEY = "_dynspec"


@dataclass(frozen=True)
class LearnedTable:
    """A table to export, and where it came from."""

    server: str
    arms: tuple[int, ...]  # the arms the server had built
    table: Table
    source: str  # "policy" or "data"
    version: int | None  # the recorded version (policy source)
    policy: str  # the policy that chose it ("greedy-by-data" for the data source)
    decided_at: float | None  # when it was recorded (policy source)
    report: ServerReport  # estimates behind it, and the data window
    buckets: Buckets  # the buckets the estimates are given for
    notes: tuple[str, ...] = ()  # buckets without data and how they were filled, ties
    # The recorded table's bands where they differ (protocol v2; policy source only):
    # ``table`` is then its band-agnostic view. Our policy file keeps them; SGLang's cannot.
    bands: BandTable | None = None


@dataclass(frozen=True)
class ExportResult:
    path: Path
    learned: LearnedTable
    warnings: tuple[str, ...]


# --- where the table comes from -----------------------------------------------------------------


def table_from_buckets(
    buckets: Sequence[BucketReport], edges: Buckets, *, min_intervals: int = DEFAULT_MIN_INTERVALS
) -> tuple[Table, tuple[str, ...]]:
    """Best arm per bucket -> a canonical table, and notes on what the data did not decide.

    Only arms with at least ``min_intervals`` intervals compete. A bucket without such an arm
    between measured buckets takes the nearest measured bucket's arm (the lower on a tie);
    buckets above the largest measured one keep its arm.

    Raises:
        ConfigError: no bucket has data.
    """
    best: list[int | None] = []
    notes: list[str] = []
    for bk in buckets:
        data = [a for a in bk.arms if a.intervals > 0 and a.goodput > 0]
        ranked = sorted((a for a in data if a.intervals >= min_intervals),
                        key=lambda a: (a.goodput, -a.arm), reverse=True)
        if not ranked and data:  # only thin data here: use it, and say so
            ranked = sorted(data, key=lambda a: (a.goodput, -a.arm), reverse=True)
            notes.append(f"b {bk.label}: k{ranked[0].arm} chosen from fewer than "
                         f"{min_intervals} intervals")
        best.append(ranked[0].arm if ranked else None)
        if len(ranked) >= 2 and _overlap(ranked[0], ranked[1]):
            notes.append(f"b {bk.label}: k{ranked[0].arm} over k{ranked[1].arm} by the point "
                         "estimate only (their 95% intervals overlap)")
        thin = [a.arm for a in data if a.intervals < min_intervals and a not in ranked]
        if thin:
            notes.append(f"b {bk.label}: k{','.join(map(str, thin))} left out (fewer than "
                         f"{min_intervals} intervals)")
    known = [i for i, k in enumerate(best) if k is not None]
    if not known:
        raise ConfigError("no observations to derive a table from")
    top = known[-1]
    filled: list[int] = []
    inside: list[str] = []
    for i, k in enumerate(best):
        if k is None:
            src = top if i > top else min(known, key=lambda j: (abs(j - i), j))
            k = best[src]
            if i < top:
                inside.append(f"{buckets[i].label} (k{k} from {buckets[src].label})")
        filled.append(int(k))  # type: ignore[arg-type]
    if inside:
        notes.insert(0, "no data at b " + ", ".join(inside) + ": filled from the nearest "
                     "measured bucket")
    if top < len(buckets) - 1:
        low = buckets[top + 1].low
        notes.insert(0, f"no data from b={low} up: the table stops at the largest measured "
                     f"bucket ({buckets[top].label}) and runs its k{best[top]} for every larger "
                     "batch; measure larger batches before trusting it there")
    return validate_table(edges.table(filled)), tuple(notes)


def _overlap(a: Any, b: Any) -> bool:
    if None in (a.ci_low, a.ci_high, b.ci_low, b.ci_high):
        return True  # no interval at all: nothing separates them
    return a.ci_low <= b.ci_high and b.ci_low <= a.ci_high


def learned_table(
    storage: Storage,
    *,
    server: str | None = None,
    source: str = "auto",
    since: float | None = None,
    buckets: Buckets | None = None,
    now: float | None = None,
) -> LearnedTable:
    """Find the table to export for one server (see the module docstring for ``source``).

    Args:
        server: the server's address; may be omitted when the history holds only one.

    Raises:
        ConfigError: unknown source, ambiguous or unknown server, nothing to export.
        StorageError: the database cannot be read.
    """
    if source not in SOURCES:
        raise ConfigError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
    if server is None:
        names = [r.address for r in storage.servers()]
        if len(names) != 1:
            listing = ", ".join(names) if names else "none"
            raise ConfigError(
                f"{storage.url} holds {len(names)} servers ({listing}): name one with --server"
            )
        server = names[0]
    buckets = buckets or Buckets()
    report = build_report(storage, server=server, since=since, buckets=buckets, now=now)
    (srv,) = report.servers
    if source in ("auto", "policy") and srv.table is not None:
        try:
            table = validate_table(srv.table.table, srv.arms or None)
        except ProtocolError as exc:
            raise ConfigError(
                f"{server}: recorded table v{srv.table.version} is not valid: {exc}"
            ) from exc
        return LearnedTable(
            server=server, arms=srv.arms, table=table, source="policy",
            version=srv.table.version, policy=srv.table.policy, decided_at=srv.table.ts,
            report=srv, buckets=buckets, bands=srv.table.bands,
        )
    if source == "policy":
        raise ConfigError(
            f"{server}: no table recorded in {storage.url} (use --source data to derive one "
            "from the observations)"
        )
    try:
        table, notes = table_from_buckets(srv.buckets, buckets)
    except ConfigError as exc:
        raise ConfigError(f"{server}: {exc} in {storage.url}") from None
    if srv.table is not None and srv.table.bands is not None:
        notes = (*notes, BANDED_DATA_NOTE)
    return LearnedTable(
        server=server, arms=srv.arms, table=table, source="data", version=None,
        policy="greedy-by-data", decided_at=None, report=srv, buckets=buckets, notes=notes,
    )


# --- sglang-adaptive ----------------------------------------------------------------------------


def padding_crossings(table: Table, graph_bs: Sequence[int] | None = None) -> list[str]:
    """Batch sizes whose CUDA-graph padding carries them into the next row's slot."""
    graph_bs = tuple(graph_bs) if graph_bs is not None else cuda_graph_bs()
    out = []
    for i, (bound, k) in enumerate(table[:-1]):
        padded = pad_batch_size(bound, graph_bs)
        if padded != bound:
            low = max([g for g in graph_bs if g < bound], default=0) + 1
            nxt = table[i + 1][1]
            if nxt != k:
                out.append(
                    f"row b<={bound}:k{k}: batch sizes {low}..{bound} pad to CUDA-graph size "
                    f"{padded} and run k{nxt} under SGLang's adaptive config (make {bound} a "
                    "captured size, or choose bucket edges that are)"
                )
    return out


def sglang_adaptive_config(
    table: Table, *, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``--speculative-adaptive-config`` JSON for a table (see the module docstring)."""
    merged = table_from_arms(validate_table(table))  # neighbouring rows of one arm as one
    cfg: dict[str, Any] = {}
    low = 1
    for bound, k in merged:
        cfg[str(low)] = {"candidate_steps": [k]}
        if bound is not None:
            low = bound + 1
    union = sorted({k for _, k in merged})
    doc = {
        "format": SGLANG_ADAPTIVE_FORMAT,
        "table": [[b, k] for b, k in merged],
        "prebuilt_arms": union,
        "note": (
            "Start SGLang with --speculative-adaptive --speculative-adaptive-config <this file>. "
            f"It pre-builds one runtime state per step in {union} (the union of candidate_steps)"
            "; --speculative-num-steps, if given, must be one of them. Each slot key is the "
            "lower batch-size bound of a table row, applied after CUDA-graph padding; one "
            "candidate step per slot, so SGLang's EMA cannot override the decision."
        ),
    }
    if meta:
        doc.update(meta)
    cfg[_META_KEY] = doc
    return cfg


def load_sglang_adaptive(path: Path) -> tuple[Table, dict[str, Any]]:
    """Read an SGLang adaptive config back as a table (one candidate per slot), with our meta.

    Raises:
        ConfigError: naming the file and what is wrong (not JSON, not an object, a slot with
            several candidates, keys that are not batch sizes ...).
    """
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a JSON file: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object of batch-size slots, got "
                          f"{type(raw).__name__}")
    if raw.get("format") == "dynspec-policy":
        raise ConfigError(f"{path}: this is a dynspec policy file, not an SGLang adaptive "
                          "config (export with --format sglang-adaptive)")
    slots: list[tuple[int, int]] = []
    for key, entry in raw.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(steps, list) or len(steps) != 1 or not isinstance(steps[0], int) \
                or isinstance(steps[0], bool) or steps[0] < 0:
            raise ConfigError(
                f"{path}: slot {key!r} must have exactly one candidate step (an int >= 0) to "
                f"be a fixed table, got {steps!r}"
            )
        slots.append((int(key), steps[0]))
    if not slots:
        raise ConfigError(f"{path}: no batch-size slots (keys like \"1\") in this file")
    slots.sort()
    if slots[0][0] > 1:
        raise ConfigError(f"{path}: the lowest slot is {slots[0][0]}; SGLang would route "
                          "smaller batches to it too, a table needs a slot \"1\"")
    if slots[0][0] < 1:
        raise ConfigError(f"{path}: slot \"0\" is not a batch size")
    rows = [(slots[i + 1][0] - 1, k) for i, (_, k) in enumerate(slots[:-1])]
    rows.append((None, slots[-1][1]))
    try:
        table = validate_table(rows)
    except ProtocolError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    meta = raw.get(_META_KEY)
    return table, meta if isinstance(meta, dict) else {}


# --- the command --------------------------------------------------------------------------------


def export(
    storage: Storage,
    *,
    fmt: str,
    out: Path,
    server: str | None = None,
    source: str = "auto",
    since: float | None = None,
    buckets: Buckets | None = None,
    now: float | None = None,
) -> ExportResult:
    """Write the learned table of one server to ``out`` in ``fmt``.

    The file is written to a temporary name and renamed, so a reader never sees half a file
    and a failed export leaves any previous file untouched.

    Raises:
        ConfigError: bad format/source/server, nothing to export, ``out`` not writable.
        StorageError: the database cannot be read.
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    from tuner.outfiles import check_out

    out = check_out(out)
    now = time.time() if now is None else now
    learned = learned_table(storage, server=server, source=source, since=since,
                            buckets=buckets, now=now)
    warnings: list[str] = list(learned.notes)
    if fmt == "sglang-adaptive":
        union = sorted({k for _, k in learned.table})
        if union == [0]:
            warnings.append(
                "the table never drafts (k=0 everywhere): running SGLang without speculative "
                "decoding is cheaper than an adaptive config that only holds k=0"
            )
        warnings.extend(padding_crossings(learned.table))
        if learned.bands is not None:
            warnings.append(
                "the table was learnt per acceptance band; SGLang's format holds one k per "
                "batch size, so its band-agnostic view is written (--format dynspec keeps "
                "the bands for the plugin)"
            )
        cfg = sglang_adaptive_config(learned.table, meta=_meta(learned, now))
        _atomic_write(out, _dump_adaptive(cfg).encode())
    else:
        from tuner import policyfile  # the plugin's format: one implementation, theirs

        try:
            policyfile.save(_policy_file(learned, now), out)
        except ValueError as exc:  # PolicyFileError (a ValueError): names the file
            raise ConfigError(str(exc)) from exc
    return ExportResult(path=out, learned=learned, warnings=tuple(warnings))


def _dump_adaptive(cfg: dict[str, Any]) -> str:
    """JSON with one line per slot and per meta field (a person reads this file)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg.items() if k != _META_KEY]
    meta = cfg.get(_META_KEY)
    if meta is not None:
        inner = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items())
        lines.append(f"  {json.dumps(_META_KEY)}: {{\n{inner}\n  }}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _meta(learned: LearnedTable, now: float) -> dict[str, Any]:
    span = learned.report.data_span
    return {
        "server": learned.server,
        "server_arms": list(learned.arms),
        "source": learned.source,
        "policy": learned.policy,
        "policy_version": learned.version,
        "exported_at": round(now, 3),
        "data_window": None if span is None else [round(span[0], 3), round(span[1], 3)],
        "table_text": format_table(learned.table),
        "notes": list(learned.notes),
    }


def _policy_file(learned: LearnedTable, now: float) -> Any:
    """Our policy file: the table, the server's arms, and the estimates behind it."""
    from tuner import __version__, policyfile

    rep = learned.report
    estimates = []
    for bk in rep.buckets:
        for a in bk.arms:
            if not math.isfinite(a.goodput):
                continue
            # The standard error behind the 95 % interval (0 where there is none).
            std = 0.0 if a.ci_high is None else (a.ci_high - a.goodput) / 1.96
            estimates.append(policyfile.Estimate(bk.index, a.arm, a.goodput, std, a.decode_steps))
    span = rep.data_span
    return policyfile.PolicyFile(
        table=learned.table,
        arms=learned.arms or tuple(sorted({k for _, k in learned.table})),
        policy_version=learned.version if learned.version is not None else 1,
        provenance=policyfile.Provenance(
            server=learned.server,
            created_at=now,
            tool_version=__version__,
            policy=learned.policy,
            buckets=learned.buckets.edges,
            data_window=policyfile.DataWindow(
                start=None if span is None else span[0],
                end=None if span is None else span[1],
                observations=rep.observations,
            ),
            estimates=tuple(estimates),
            notes=learned.notes,
        ),
        bands=learned.bands,
    )


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data, parents=False)  # tuner.outfiles: folders are never created
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from exc


