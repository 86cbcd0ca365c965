"""One rule for every ``--out``: the folder must already exist; nothing creates folders.

A typo in a path (``--out /reprots/r.html``) then fails at once, in one line, instead of
creating a stray tree (as root, at ``/``) or failing only after a long sweep.
"""

from __future__ import annotations

from pathlib import Path

from tuner.errors import ConfigError

__all__ = ["check_out"]


def check_out(path: Path | str, *, flag: str = "--out") -> Path:
    """``path`` as a :class:`Path` when its folder exists and it is not itself a folder.

    Raises:
        ConfigError: naming the flag, the path and what to do.
    """
    out = Path(path)
    if not out.name or str(path).endswith("/"):
        raise ConfigError(f"{flag} {str(path)!r}: name a file")
    folder = out.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{flag} {out}: the folder {folder} {what} (create it first; "
                          "dynspec-tuner writes files, never folders)")
    if out.is_dir():
        raise ConfigError(f"{flag} {out}: is a folder; name a file in it")
    return out
