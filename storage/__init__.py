"""History of what the daemon saw and decided: servers, observations, policy versions, events.

One :class:`Storage` class over SQLAlchemy 2 (SQLite by default, PostgreSQL for fleets).
Records in and out are frozen dataclasses; no ORM object or session leaves this package.

    >>> from storage import Storage
    >>> with Storage("sqlite:///dynspec.db") as st:          # doctest: +SKIP
    ...     for agg in st.aggregate(server="localhost:30000"):
    ...         print(agg.b, agg.k, round(agg.goodput))
"""

from __future__ import annotations

from storage import _records
from storage._engine import DEFAULT_BUSY_TIMEOUT_S, DEFAULT_URL, redact_url
from storage._models import SCHEMA_VERSION
from storage._pooling import DEFAULT_WARM_START_ROWS
from storage._records import *  # noqa: F403  (the frozen records, listed in _records)
from storage._storage import Storage

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_S",
    "DEFAULT_URL",
    "DEFAULT_WARM_START_ROWS",
    "SCHEMA_VERSION",
    "Storage",
    "redact_url",
]
__all__ += _records.__all__
