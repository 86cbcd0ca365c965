"""The read direction: the ``"dynspec"`` section of ``GET /server_info`` (v1 and v2).

Protocol v2 keeps the readout bounded whatever the uptime (docs/protocol.md): per
``(b, k)`` only what cannot be derived (decode steps, accepted drafts, busy microseconds), in
base-64 digits, one string per arm that is dense over batch sizes; per ``(class, band, k)``
the steps, requests and accepted drafts that tell acceptance by band; per chain arm, how many
drafts the requests accepted (what shallower arms would have accepted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tuner.protocol._bands import (
    COUNTED_MAX_BATCH,
    N_BANDS,
    N_CLASSES,
    UNKNOWN_BAND,
    BandTable,
    band_agnostic,
    band_table_to_json,
    banded,
    is_uniform,
    class_range,
    validate_band_table,
)
from tuner.protocol._base import (
    MAX_INT,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    ProtocolError,
    Table,
    _as_float,
    _as_int,
    table_from_json,
    table_to_json,
)
from tuner.protocol._update import Probe, probes_to_json, validate_probes

# --- base-64 digits ---------------------------------------------------------------------------

# Digits 0-9 first, so small numbers read as themselves; none of them needs a JSON escape.
DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_"
_VALUE = {c: i for i, c in enumerate(DIGITS)}
_MAX_DIGITS = 9  # 64**9 = 2**54 > MAX_INT
# A readout never has more cells per arm than this (batch sizes): refuses hostile sizes early.
MAX_CELLS = 1 << 16


def b64_int(n: int) -> str:
    """A non-negative integer in base-64 digits (``DIGITS``), most significant first."""
    if n < 64:
        return DIGITS[n]
    out = []
    while n:
        n, r = divmod(n, 64)
        out.append(DIGITS[r])
    return "".join(reversed(out))


def int_b64(text: str, what: str) -> int:
    if not text or len(text) > _MAX_DIGITS:
        raise ProtocolError(f"{what}: {text!r} is not a base-64 number of 1..{_MAX_DIGITS} digits")
    n = 0
    for c in text:
        v = _VALUE.get(c)
        if v is None:
            raise ProtocolError(f"{what}: {text!r} has a character outside the digits")
        n = n * 64 + v
    if n > MAX_INT:
        raise ProtocolError(f"{what} must be within 2^53, got {n}")
    return n


def encode_cells(cells: Iterable[tuple[int, ...] | None]) -> str:
    """``;``-separated cells, each empty (never seen) or ``,``-separated numbers."""
    return ";".join("" if c is None else ",".join(map(b64_int, c)) for c in cells)


def decode_cells(text: object, width: int | tuple[int, ...], what: str
                 ) -> list[tuple[int, ...] | None]:
    widths = (width,) if isinstance(width, int) else width
    if not isinstance(text, str):
        raise ProtocolError(f"{what} must be a string of cells, got {type(text).__name__}")
    if text.count(";") >= MAX_CELLS:
        raise ProtocolError(f"{what} has more than {MAX_CELLS} cells")
    out: list[tuple[int, ...] | None] = []
    for i, cell in enumerate(text.split(";")):
        if not cell:
            out.append(None)
            continue
        parts = cell.split(",")
        if len(parts) not in widths:
            raise ProtocolError(f"{what} cell {i} must have {' or '.join(map(str, widths))} "
                                f"numbers: {cell!r}")
        out.append(tuple(int_b64(p, f"{what} cell {i}") for p in parts))
    return out


# --- counters -------------------------------------------------------------------------------

COUNTER_FIELDS = (
    "b",
    "k",
    "decode_steps",
    "emitted_tokens",
    "accepted_drafts",
    "drafted_tokens",
    "busy_s",
)


@dataclass(frozen=True, slots=True)
class CounterRow:
    """Cumulative counters of one ``(batch size, arm)`` since the server started."""

    b: int
    k: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float

    def to_json(self) -> list[int | float]:
        return [
            self.b,
            self.k,
            self.decode_steps,
            self.emitted_tokens,
            self.accepted_drafts,
            self.drafted_tokens,
            self.busy_s,
        ]

    @classmethod
    def from_json(cls, row: object) -> CounterRow:
        if not isinstance(row, (list, tuple)) or len(row) != len(COUNTER_FIELDS):
            raise ProtocolError(f"counter row must have {len(COUNTER_FIELDS)} numbers: {row!r}")
        ints = [_as_int(v, f"counter {name}") for v, name in zip(row[:6], COUNTER_FIELDS)]
        busy = _as_float(row[6], "counter busy_s")
        if min(ints) < 0 or busy < 0:
            raise ProtocolError(f"counter row has a negative value: {row!r}")
        if ints[0] < 1:
            raise ProtocolError(f"counter batch size must be >= 1: {row!r}")
        return cls(*ints, float(busy))


def counter_deltas(
    before: Iterable[CounterRow], after: Iterable[CounterRow]
) -> tuple[CounterRow, ...] | None:
    """What accrued between two readings of one replica's cumulative counters.

    Returns the per-``(b, k)`` differences that contain decode steps, in ``(b, k)`` order, or
    None when the counters cannot come from the same run (a row vanished or a counter went
    backwards: the server restarted in between). Busy seconds tolerate float round-off.
    """
    old = {(c.b, c.k): c for c in before}
    new = {(c.b, c.k): c for c in after}
    if any(key not in new for key in old):
        return None
    out = []
    for key in sorted(new):
        c, o = new[key], old.get(key)
        if o is None:
            d = c
        else:
            d = CounterRow(
                c.b,
                c.k,
                c.decode_steps - o.decode_steps,
                c.emitted_tokens - o.emitted_tokens,
                c.accepted_drafts - o.accepted_drafts,
                c.drafted_tokens - o.drafted_tokens,
                max(c.busy_s - o.busy_s, 0.0),
            )
            if min(d.decode_steps, d.emitted_tokens, d.accepted_drafts, d.drafted_tokens) < 0 or (
                c.busy_s < o.busy_s - 1e-9
            ):
                return None
        if d.decode_steps:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The draft tree a server's non-zero arm runs (``--speculative-eagle-topk`` > 1).

    A tree server has two arms, ``0`` and ``steps``; the readout names the arm by its depth
    ``steps`` and describes the tree here. Its counters keep the chain meaning of
    ``drafted_tokens``: ``steps`` per request (the depth a verify can accept), not the
    ``draft_tokens - 1`` tree nodes, so ``accepted / drafted`` stays a per-depth rate in [0, 1].
    """

    topk: int
    steps: int
    draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("topk", "steps", "draft_tokens"):
            _as_int(getattr(self, name), f"tree {name}")
        if self.topk < 2:
            raise ProtocolError(f"tree topk must be >= 2 (1 is a chain), got {self.topk}")
        if self.steps < 1:
            raise ProtocolError(f"tree steps must be >= 1, got {self.steps}")
        if self.draft_tokens < 2:
            raise ProtocolError(f"tree draft_tokens must be >= 2, got {self.draft_tokens}")

    def to_json(self) -> dict[str, int]:
        return {"topk": self.topk, "steps": self.steps, "draft_tokens": self.draft_tokens}

    @classmethod
    def from_json(cls, obj: object) -> TreeShape:
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"tree must be an object, got {type(obj).__name__}")
        try:
            return cls(
                topk=_as_int(obj["topk"], "tree topk"),
                steps=_as_int(obj["steps"], "tree steps"),
                draft_tokens=_as_int(obj["draft_tokens"], "tree draft_tokens"),
            )
        except KeyError as exc:
            raise ProtocolError(f"tree lacks field {exc.args[0]!r}") from exc


@dataclass(frozen=True, slots=True)
class BandCounter:
    """Cumulative counters of one ``(batch-size class, acceptance band, arm)`` (protocol v2).

    A step counts in the band the plugin's estimate was in just before the step's own verify
    result was folded in (so a step never selects its own band). Summed over bands, a class's
    counters equal the ``(b, k)`` rows of its batch sizes: the same timed steps.

    ``first_rejected`` counts the requests that accepted none of their drafts where that tells
    something (:attr:`first_counted`): in a known band, at ``k >= 2``, in the classes of
    batches up to :data:`COUNTED_MAX_BATCH` requests; elsewhere 0. With ``accepted_drafts``
    it tells how acceptance falls with depth on the same requests.
    """

    cls: int
    band: int
    k: int
    decode_steps: int
    requests: int
    accepted_drafts: int
    first_rejected: int = 0

    @property
    def first_counted(self) -> int:
        """The requests :attr:`first_rejected` looked at: all of them or none."""
        high = class_range(self.cls)[1]
        counted = (self.band != UNKNOWN_BAND and self.k >= 2 and high is not None
                   and high <= COUNTED_MAX_BATCH)
        return self.requests if counted else 0


def band_counter_deltas(
    before: Iterable[BandCounter], after: Iterable[BandCounter]
) -> tuple[BandCounter, ...] | None:
    """As :func:`counter_deltas`, for band counters (None: they cannot be from one run)."""
    old = {(c.cls, c.band, c.k): c for c in before}
    new = {(c.cls, c.band, c.k): c for c in after}
    if any(key not in new for key in old):
        return None
    out = []
    for key in sorted(new):
        c, o = new[key], old.get(key)
        d = c if o is None else BandCounter(
            *key, c.decode_steps - o.decode_steps, c.requests - o.requests,
            c.accepted_drafts - o.accepted_drafts, c.first_rejected - o.first_rejected,
        )
        if min(d.decode_steps, d.requests, d.accepted_drafts, d.first_rejected) < 0:
            return None
        if d.decode_steps:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DepthCounter:
    """How many drafts each request accepted at chain arm ``k >= 2`` (protocol v2).

    ``counts[a]`` is the cumulative number of requests that accepted exactly ``a`` of their
    ``k`` drafts, on the steps the plugin samples (one in :data:`DEPTH_EVERY`, at most
    :data:`COUNTED_MAX_BATCH` requests of each). A chain's first ``j`` drafts are the same
    whatever its depth, so these counts tell what every shallower arm would have accepted on
    the same requests: ``sum(min(a, j) * counts[a])`` accepted drafts over ``sum(counts)``
    request-steps at arm ``j < k``.
    """

    k: int
    counts: tuple[int, ...]

    @property
    def requests(self) -> int:
        return sum(self.counts)

    def accepted_at(self, j: int) -> int:
        """Accepted drafts the counted requests would have had at depth ``j <= k``."""
        return sum(min(a, j) * n for a, n in enumerate(self.counts))


def depth_counter_deltas(
    before: Iterable[DepthCounter], after: Iterable[DepthCounter]
) -> tuple[DepthCounter, ...] | None:
    """As :func:`counter_deltas`, for depth counters (None: they cannot be from one run)."""
    old = {c.k: c for c in before}
    new = {c.k: c for c in after}
    if any(k not in new for k in old):
        return None
    out = []
    for k in sorted(new):
        c, o = new[k], old.get(k)
        d = c.counts if o is None else tuple(x - y for x, y in zip(c.counts, o.counts))
        if min(d) < 0:
            return None
        if any(d):
            out.append(DepthCounter(k, d))
    return tuple(out)


def _encode_depths(depths: Iterable[DepthCounter]) -> list[list[int | str]]:
    return [[d.k, encode_cells([d.counts])] for d in sorted(depths, key=lambda d: d.k)]


def _decode_depths(obj: object, arms: tuple[int, ...]) -> tuple[DepthCounter, ...]:
    if not isinstance(obj, list):
        raise ProtocolError("depths must be a list of [k, counts]")
    out: list[DepthCounter] = []
    for entry in obj:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ProtocolError(f"depths entry must be [k, counts]: {entry!r:.80}")
        k = _as_int(entry[0], "depth counter k")
        if k < 2 or k not in arms or any(d.k == k for d in out):
            raise ProtocolError(f"depth counter k={k} is not an arm >= 2, or repeated")
        cells = decode_cells(entry[1], k + 1, f"depths k={k}")
        if len(cells) != 1 or cells[0] is None:
            raise ProtocolError(f"depths k={k} must hold one cell of {k + 1} numbers")
        out.append(DepthCounter(k, cells[0]))
    return tuple(out)


def _encode_counters(counters: Iterable[CounterRow]) -> list[list[int | str]]:
    by_k: dict[int, dict[int, CounterRow]] = {}
    for c in counters:
        by_k.setdefault(c.k, {})[c.b] = c
    out: list[list[int | str]] = []
    for k in sorted(by_k):
        cells = by_k[k]
        dense = (cells.get(b) for b in range(1, max(cells) + 1))
        out.append([k, encode_cells(
            None if c is None else (c.decode_steps, c.accepted_drafts, round(c.busy_s * 1e6))
            for c in dense
        )])
    return out


def _decode_counters(obj: object) -> tuple[CounterRow, ...]:
    if not isinstance(obj, list):
        raise ProtocolError("counters must be a list of [k, cells]")
    rows: list[CounterRow] = []
    seen: set[int] = set()
    for entry in obj:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ProtocolError(f"counters entry must be [k, cells]: {entry!r:.80}")
        k = _as_int(entry[0], "counter k")
        if k < 0 or k in seen:
            raise ProtocolError(f"counter arm {k} is negative or repeated")
        seen.add(k)
        for b, cell in enumerate(decode_cells(entry[1], 3, f"counters k={k}"), start=1):
            if cell is None:
                continue
            n, accepted, busy_us = cell
            # EAGLE emits one token per request besides the accepted drafts, and a step of
            # arm k drafts k per request: v1's emitted and drafted columns, derived.
            emitted, drafted = accepted + b * n, k * b * n
            if max(emitted, drafted) > MAX_INT:
                raise ProtocolError(f"counter (b={b}, k={k}) is beyond 2^53")
            rows.append(CounterRow(b, k, n, emitted, accepted, drafted, busy_us / 1e6))
    rows.sort(key=lambda c: (c.b, c.k))
    return tuple(rows)


def _encode_bands(bands: Iterable[BandCounter]) -> list[list[int | str]]:
    by_kb: dict[tuple[int, int], dict[int, BandCounter]] = {}
    for c in bands:
        by_kb.setdefault((c.k, c.band), {})[c.cls] = c
    out: list[list[int | str]] = []
    for (k, band) in sorted(by_kb):
        cells = by_kb[(k, band)]
        dense = (cells.get(i) for i in range(max(cells) + 1))
        out.append([k, band, encode_cells(
            None if c is None else (c.decode_steps, c.requests, c.accepted_drafts)
            + ((c.first_rejected,) if c.first_rejected else ()) for c in dense
        )])
    return out


def _decode_bands(obj: object) -> tuple[BandCounter, ...]:
    if not isinstance(obj, list):
        raise ProtocolError("bands must be a list of [k, band, cells]")
    out: list[BandCounter] = []
    seen: set[tuple[int, int]] = set()
    for entry in obj:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ProtocolError(f"bands entry must be [k, band, cells]: {entry!r:.80}")
        k, band = _as_int(entry[0], "band counter k"), _as_int(entry[1], "band counter band")
        if k < 0 or not 0 <= band < N_BANDS or (k, band) in seen:
            raise ProtocolError(f"band counter (k={k}, band={band}) is out of range or repeated")
        seen.add((k, band))
        # A cell's fourth number, first_rejected, is left out where it is 0 (so where nothing
        # is counted, and in the readouts of plugins before it).
        cells = decode_cells(entry[2], (3, 4), f"bands k={k} band={band}")
        if len(cells) > N_CLASSES:
            raise ProtocolError(f"bands k={k} band={band} has more than {N_CLASSES} classes")
        for i, c in enumerate(cells):
            if c is None:
                continue
            if len(c) == 4 and c[3] > c[1]:
                raise ProtocolError(f"bands k={k} band={band} cell {i} has more first-draft "
                                    "rejections than requests")
            out.append(BandCounter(i, band, k, *c))
    out.sort(key=lambda c: (c.cls, c.band, c.k))
    return tuple(out)


# --- the section ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynspecState:
    """The ``"dynspec"`` section one DP replica reports.

    ``table`` is band-agnostic (each row's unknown-band ``k``: what v1 readers and today's
    daemon work with); ``band_table`` is the full banded table when its bands differ.
    ``bands`` and ``acceptance`` (the live estimate: band and alpha, alpha None when unknown)
    exist from protocol v2 on.
    """

    arms: tuple[int, ...]
    policy_version: int
    table: Table
    counters: tuple[CounterRow, ...]
    started_at: float
    updates_applied: int = 0
    updates_rejected: int = 0
    hooks_live: bool = True
    reason: str | None = None
    untimed_steps: int = 0
    last_rejection: str | None = None
    protocol: int = PROTOCOL_VERSION
    # Present only on a tree server (v1-compatible: readers that do not know it ignore it).
    tree: TreeShape | None = None
    band_table: BandTable | None = None
    bands: tuple[BandCounter, ...] = ()
    acceptance: tuple[int, float | None] | None = None
    # Live probes (v2), steps left rather than steps sent: omitted when none.
    probes: tuple[Probe, ...] = ()
    # Accepted-draft counts per chain arm (v2; read as none from a plugin before them).
    depths: tuple[DepthCounter, ...] = ()

    @property
    def banded_table(self) -> BandTable:
        return self.band_table if self.band_table is not None else banded(self.table)

    def to_json(self) -> dict[str, Any]:
        v2 = self.protocol >= 2
        out: dict[str, Any] = {
            "protocol": self.protocol,
            "arms": list(self.arms),
            "policy_version": self.policy_version,
            "table": (
                band_table_to_json(self.banded_table) if v2 else table_to_json(self.table)
            ),
            "counters": (
                _encode_counters(self.counters) if v2 else [c.to_json() for c in self.counters]
            ),
            "started_at": self.started_at,
            "updates_applied": self.updates_applied,
            "updates_rejected": self.updates_rejected,
            "hooks_live": self.hooks_live,
            "untimed_steps": self.untimed_steps,
        }
        if v2:
            out["bands"] = _encode_bands(self.bands)
            if self.acceptance is not None:
                band, alpha = self.acceptance
                # Per mille: the estimate's resolution that matters, in a few characters.
                out["acceptance"] = [band, None if alpha is None else round(alpha * 1000)]
            if self.probes:
                out["probes"] = probes_to_json(self.probes)
            out["depths"] = _encode_depths(self.depths)
        if self.reason is not None:
            out["reason"] = self.reason
        if self.last_rejection is not None:
            out["last_rejection"] = self.last_rejection
        if self.tree is not None:
            out["tree"] = self.tree.to_json()
        return out

    @classmethod
    def from_json(cls, obj: object) -> DynspecState:
        """Parse and validate a readout of any supported protocol version.

        Raises:
            ProtocolError: on any missing or malformed field, or an unknown protocol version.
        """
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"dynspec section must be an object, got {type(obj).__name__}")
        try:
            return cls._from_json(obj)
        except KeyError as exc:
            raise ProtocolError(f"dynspec section lacks field {exc.args[0]!r}") from exc

    @classmethod
    def _from_json(cls, obj: Mapping[str, Any]) -> DynspecState:
        proto = _as_int(obj["protocol"], "protocol")
        if proto not in SUPPORTED_PROTOCOLS:
            raise ProtocolError(
                f"protocol version mismatch: server speaks v{proto}, this side reads "
                f"{'/'.join(f'v{p}' for p in SUPPORTED_PROTOCOLS)}"
            )
        arms_raw = obj["arms"]
        if not isinstance(arms_raw, list) or not arms_raw:
            raise ProtocolError("arms must be a non-empty list")
        arms = tuple(sorted({_as_int(a, "arm") for a in arms_raw}))
        if arms[0] < 0:
            raise ProtocolError(f"arms must be >= 0, got {list(arms)}")
        counters_raw = obj["counters"]
        started = obj["started_at"]
        if isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ProtocolError(f"started_at must be a number, got {started!r}")
        # Finite: NaN never equals itself, and would read as a restart at every tick.
        started = _as_float(started, "started_at")
        version = _as_int(obj["policy_version"], "policy_version")
        if version < 0:
            raise ProtocolError(f"policy_version must be >= 0, got {version}")
        tree = None if obj.get("tree") is None else TreeShape.from_json(obj["tree"])
        if tree is not None and tree.steps not in arms:
            raise ProtocolError(f"tree steps {tree.steps} is not among arms {list(arms)}")
        hooks_live = obj.get("hooks_live", True)
        if not isinstance(hooks_live, bool):
            # bool("false") is True: a malformed flag must not read as live hooks.
            raise ProtocolError(f"hooks_live must be true or false, got {hooks_live!r}")
        band_table: BandTable | None = None
        bands: tuple[BandCounter, ...] = ()
        acceptance = None
        probes: tuple[Probe, ...] = ()
        depths: tuple[DepthCounter, ...] = ()
        if proto >= 2:
            if not isinstance(obj["table"], list):
                raise ProtocolError("table must be a JSON list")
            bt = validate_band_table(obj["table"], arms)
            table = band_agnostic(bt)
            band_table = None if is_uniform(bt) else bt
            counters = _decode_counters(counters_raw)
            bands = _decode_bands(obj.get("bands", []))
            acceptance = _parse_acceptance(obj.get("acceptance"))
            raw_probes = obj.get("probes", [])
            if not isinstance(raw_probes, list):
                raise ProtocolError(f"probes must be a list, got {raw_probes!r:.80}")
            probes = validate_probes(raw_probes, arms)
            depths = _decode_depths(obj.get("depths", []), arms)
        else:
            if not isinstance(counters_raw, list):
                raise ProtocolError("counters must be a list")
            table = table_from_json(obj["table"], arms)
            counters = tuple(CounterRow.from_json(r) for r in counters_raw)
        return cls(
            arms=arms,
            policy_version=version,
            table=table,
            counters=counters,
            started_at=started,
            updates_applied=_as_int(obj.get("updates_applied", 0), "updates_applied"),
            updates_rejected=_as_int(obj.get("updates_rejected", 0), "updates_rejected"),
            hooks_live=hooks_live,
            reason=None if obj.get("reason") is None else str(obj.get("reason")),
            untimed_steps=_as_int(obj.get("untimed_steps", 0), "untimed_steps"),
            last_rejection=(
                None if obj.get("last_rejection") is None else str(obj["last_rejection"])
            ),
            protocol=proto,
            tree=tree,
            band_table=band_table,
            bands=bands,
            acceptance=acceptance,
            probes=probes,
            depths=depths,
        )


def _parse_acceptance(raw: object) -> tuple[int, float | None] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 2:
        raise ProtocolError(f"acceptance must be [band, alpha per mille], got {raw!r:.80}")
    band = _as_int(raw[0], "acceptance band")
    if not 0 <= band < N_BANDS:
        raise ProtocolError(f"acceptance band must be in 0..{N_BANDS - 1}, got {band}")
    if raw[1] is None:
        return band, None
    permille = _as_int(raw[1], "acceptance alpha")
    if not 0 <= permille <= 1000:
        raise ProtocolError(f"acceptance alpha must be in 0..1000 per mille, got {permille}")
    return band, permille / 1000
