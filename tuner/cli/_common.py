"""What the command modules share: the consoles (the CLI is the only place that prints),
the making of a command's parser, the history flag and the flag converters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console

from tuner.errors import ConfigError

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)


def _command(sub: argparse._SubParsersAction, name: str,
             run: Callable[[argparse.Namespace], int], description: str | None, *,
             help: str) -> argparse.ArgumentParser:
    """The parser of one command, ``run`` its handler. ``description`` (``--help``'s text) is
    the command module's docstring: one text for whoever reads the code or the help."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=run)
    return p


def _history_option(p: argparse.ArgumentParser) -> None:
    """``--db``, the history that :func:`_history_url` resolves."""
    p.add_argument("--db", metavar="URL",
                   help="history database (default: DYNSPEC_DB, else sqlite:///dynspec.db)")


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _history_url(flag: str | None) -> str:
    import os

    from tuner.config import DEFAULT_DB_URL

    return flag or os.environ.get("DYNSPEC_DB") or DEFAULT_DB_URL


def _buckets_arg(edges: tuple[int, ...] | None) -> Buckets | None:  # noqa: F821 (lazy)
    from policies import Buckets

    if not edges:
        return None
    try:
        return Buckets(edges)
    except ValueError as exc:
        raise ConfigError(f"--buckets: {exc}") from exc
