"""``dynspec-tuner``: parse, build the config, call the library. The only module that prints.

Each subcommand is a pair ``_add_<name>(subparsers)`` / ``_cmd_<name>(args) -> int``, listed
in ``_COMMANDS``. Exit codes: 0 ok, 1 a runtime failure (DynspecError), 2 a usage or
configuration error (argparse, ConfigError), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from tuner import __version__
from tuner.errors import ConfigError, DynspecError

__all__ = ["main"]

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


# --- subcommands ----------------------------------------------------------------------------
# (Each command's parser and handler stay together; the library does the work.)


_COMMANDS: list[tuple[str, Callable[[argparse._SubParsersAction], None]]] = []


def _command(add: Callable[[argparse._SubParsersAction], None]):
    _COMMANDS.append((add.__name__, add))
    return add


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynspec-tuner",
        description=(
            "Learns, per batch-size bucket, how many speculative draft steps pay on an SGLang "
            "server, and hot-updates the server's per-batch decision."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for _, add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        if args.debug:
            raise
        err_console.print(f"dynspec-tuner {args.command}: error: {exc}", markup=False)
        return 2
    except DynspecError as exc:
        if args.debug:
            raise
        err_console.print(f"dynspec-tuner {args.command}: {exc}", markup=False)
        return 1
    except KeyboardInterrupt:
        err_console.print("interrupted", markup=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
