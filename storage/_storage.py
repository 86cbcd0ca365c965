"""The one storage class: SQLAlchemy 2 over SQLite (default) or PostgreSQL.

:class:`Storage` is composed of one mixin per concern, each in its own private module over
:class:`~storage._engine.StorageCore` (engine, sessions, errors):

- ``_schema``: create, check and migrate the tables when it opens;
- ``_servers``: the server registry (:meth:`~Storage.servers`, :meth:`~Storage.server`);
- ``_writes``: :meth:`~Storage.record_tick` (over the registry);
- ``_rollup``: :meth:`~Storage.rollup`;
- ``_queries``: observations and their sums, policy versions, events;
- ``_pooling``: :meth:`~Storage.warm_start` and the live pool readers.

``_sql`` holds the SQL shapes and row conversions they share.
"""

from __future__ import annotations

from storage._engine import DEFAULT_BUSY_TIMEOUT_S, DEFAULT_URL
from storage._pooling import PoolingMixin
from storage._queries import QueriesMixin
from storage._rollup import RollupMixin
from storage._schema import SchemaMixin
from storage._writes import WritesMixin

__all__ = ["Storage"]


class Storage(SchemaMixin, WritesMixin, RollupMixin, QueriesMixin, PoolingMixin):
    """History of servers, observations, policy versions and events.

    Thread-safe: every method opens and closes its own session. Records returned are frozen
    and never change after later writes. Every database failure surfaces as
    :class:`~tuner.errors.StorageError` naming the URL with its password redacted.

    Args:
        url: an SQLAlchemy URL; SQLite files run in WAL mode so readers (reports) never
            block the daemon's writes.
        busy_timeout_s: how long a SQLite write waits for a competing writer.
        read_only: for readers (reports, export): neither creates tables nor checks that
            the database is writable.

    Raises:
        StorageError: the URL cannot be parsed or opened, its driver is missing, the file
            is read-only or locked (unless ``read_only``), or its schema is newer than ours.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        read_only: bool = False,
        echo: bool = False,
    ) -> None:
        self._open(url, busy_timeout_s=busy_timeout_s, read_only=read_only, echo=echo)
        try:
            self._prepare()
        except BaseException:
            self._engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"
