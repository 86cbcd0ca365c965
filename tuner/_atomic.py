"""Atomic file writes (standard library only: the plugin imports this inside SGLang)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644, parents: bool = True
) -> Path:
    """Write ``data`` through a temp file in the same directory and a rename.

    A reader (a server starting, a daemon warm-starting) sees the old file or the new one,
    never half of one. ``mode`` replaces mkstemp's 0600, which would hide the file from a
    server running as another user. ``parents`` creates missing directories.

    Raises:
        OSError: the file or its directory cannot be written.
    """
    target = Path(path)
    if parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
