"""SQLAlchemy 2 typed models of the history database. Private: nothing here leaves storage/.

Portable types only (SQLite and PostgreSQL): times are UTC epoch seconds as doubles, tables
and arm lists are JSON text, counters are 64-bit integers.
"""

from __future__ import annotations

from typing import Annotated

from sqlalchemy import BigInteger, Double, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Bumped whenever a table changes shape; Storage refuses a database newer than it knows and
# migrates older ones step by step. v2: observations carry their own moments (interval count,
# sums of squares) and a roll-up marker, so old rows can be merged without losing what the
# report's intervals need. v3: servers carry the model they run and since when, so a server
# redeployed with another model is not warm-started from what the old one taught. v4: the
# acceptance evidence of protocol v2 (band and depth counters), so a restarted daemon's
# policy starts with the bands it had learnt; new tables only, nothing to migrate in place.
SCHEMA_VERSION = 4

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
_BigId = BigInteger().with_variant(Integer(), "sqlite")

pk = Annotated[int, mapped_column(_BigId, primary_key=True, autoincrement=True)]
epoch_s = Annotated[float, mapped_column(Double)]
counter = Annotated[int, mapped_column(BigInteger)]


class Base(DeclarativeBase):
    type_annotation_map = {str: String(255)}


class SchemaVersionModel(Base):
    __tablename__ = "schema_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[epoch_s]


class ServerModel(Base):
    __tablename__ = "servers"

    id: Mapped[pk]
    address: Mapped[str] = mapped_column(String(255), unique=True)
    arms_json: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[epoch_s]
    last_seen: Mapped[epoch_s]
    started_at: Mapped[float | None] = mapped_column(Double)
    # Every start time this server reported, JSON list: one entry per restart.
    start_times_json: Mapped[str] = mapped_column(Text, default="[]")
    pool: Mapped[str | None] = mapped_column(String(255))
    # v3; deferred, so a read-only look at an unmigrated v2 history never selects them.
    model: Mapped[str | None] = mapped_column(String(255), deferred=True)
    # When this address started running ``model`` (None: as far back as the history goes).
    model_since: Mapped[float | None] = mapped_column(Double, deferred=True)


# Columns v3 adds to ``servers`` (name, DDL), for the in-place migration.
SERVER_V3_COLUMNS: tuple[tuple[str, str], ...] = (
    ("model", "VARCHAR(255)"),
    ("model_since", "DOUBLE PRECISION"),
)


class ObservationModel(Base):
    __tablename__ = "observations"
    __table_args__ = (Index("ix_observations_server_ts", "server_id", "ts"),)

    id: Mapped[pk]
    server_id: Mapped[int] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    ts: Mapped[epoch_s]
    b: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)
    decode_steps: Mapped[counter]
    emitted_tokens: Mapped[counter]
    accepted_drafts: Mapped[counter]
    drafted_tokens: Mapped[counter]
    busy_s: Mapped[float] = mapped_column(Double)
    # Schema v2. A row is one sampling interval when fresh; a rolled-up row (Storage.rollup)
    # sums several. The moments are NULL on a fresh row, meaning "the row's own values"
    # (e*e, e*t, t*t): nothing extra is written per tick, and a v1 writer still sharing the
    # database stays correct.
    n_intervals: Mapped[int] = mapped_column(BigInteger, default=1, server_default=text("1"))
    emitted_sq: Mapped[float | None] = mapped_column(Double)  # Σ e²
    emitted_busy: Mapped[float | None] = mapped_column(Double)  # Σ e·t
    busy_sq: Mapped[float | None] = mapped_column(Double)  # Σ t²
    # NULL: a fresh row as recorded. Otherwise the width of the time bin it was rolled into:
    # live pool readers skip such rows (their content was read when it was fresh).
    rollup_bin_s: Mapped[float | None] = mapped_column(Double)


# Columns schema v2 added to observations, with their DDL type (portable SQLite/PostgreSQL),
# for migrating a v1 database in place.
OBSERVATION_V2_COLUMNS: tuple[tuple[str, str], ...] = (
    ("n_intervals", "BIGINT NOT NULL DEFAULT 1"),
    ("emitted_sq", "DOUBLE PRECISION"),
    ("emitted_busy", "DOUBLE PRECISION"),
    ("busy_sq", "DOUBLE PRECISION"),
    ("rollup_bin_s", "DOUBLE PRECISION"),
)


class BandObservationModel(Base):
    """Schema v4: one interval's drafting in one acceptance band at one arm and batch-size
    class (a protocol v2 band counter's delta). Kept for warm starts only, so old rows are
    dropped, not rolled up (``Storage.rollup``)."""

    __tablename__ = "band_observations"
    __table_args__ = (Index("ix_band_observations_server_ts", "server_id", "ts"),)

    id: Mapped[pk]
    server_id: Mapped[int] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    ts: Mapped[epoch_s]
    band: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)
    decode_steps: Mapped[counter]
    request_steps: Mapped[counter]
    accepted_drafts: Mapped[counter]
    first_counted: Mapped[counter]
    first_rejected: Mapped[counter]


class DepthCountsModel(Base):
    """Schema v4: one interval's depth counters at one chain arm ``k >= 2``: how many
    sampled requests accepted 0..k drafts (JSON list), one decode step in ``every``
    counted. For warm starts only, as :class:`BandObservationModel`."""

    __tablename__ = "depth_counts"
    __table_args__ = (Index("ix_depth_counts_server_ts", "server_id", "ts"),)

    id: Mapped[pk]
    server_id: Mapped[int] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    ts: Mapped[epoch_s]
    k: Mapped[int] = mapped_column(Integer)
    counts_json: Mapped[str] = mapped_column(Text)
    every: Mapped[int] = mapped_column(Integer)


class PolicyVersionModel(Base):
    __tablename__ = "policy_versions"
    __table_args__ = (Index("ix_policy_versions_server_ts", "server_id", "ts"),)

    id: Mapped[pk]
    server_id: Mapped[int] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    ts: Mapped[epoch_s]
    version: Mapped[int] = mapped_column(BigInteger)
    table_json: Mapped[str] = mapped_column(Text)
    policy: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(String(32))


class EventModel(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_ts", "ts"),)

    id: Mapped[pk]
    # None for events of the daemon itself (e.g. the database coming back).
    server_id: Mapped[int | None] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    ts: Mapped[epoch_s]
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="")
