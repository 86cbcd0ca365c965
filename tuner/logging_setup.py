"""Log output of the command line: human lines or JSON lines, at a chosen level.

``--log-format json`` writes one JSON object per record on stderr (``ts``, ``level``,
``logger``, ``message``, plus ``exc`` with a traceback only under ``--debug``), which
journald, Loki or any log shipper takes as is. ``--log-level`` sets the threshold;
``--debug`` implies ``debug`` unless a level is given.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import TextIO

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "configure_logging"]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; tracebacks only when ``tracebacks`` is set."""

    def __init__(self, *, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and record.exc_info[1] is not None:
            doc["error"] = repr(record.exc_info[1])
            if self.tracebacks:
                doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure_logging(
    *, level: str | None, fmt: str = "text", debug: bool = False, stream: TextIO | None = None
) -> None:
    """Replace the root logger's handlers with one on ``stream`` (stderr).

    Raises:
        ValueError: an unknown level or format.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    name = level or ("debug" if debug else "info")
    if name not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {name!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter(tracebacks=debug) if fmt == "json"
                         else logging.Formatter(_TEXT_FORMAT))
    handler._dynspec = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in list(root.handlers):  # ours from an earlier call; others' (pytest's) stay
        if getattr(h, "_dynspec", False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, name.upper()))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced after setup)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass
