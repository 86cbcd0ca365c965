"""``dynspec-tuner``: parse, build the config, call the library. The only package that prints.

Each subcommand lives in its own module, ``_<name>.py``: a pair ``_add_<name>(subparsers)`` /
``_cmd_<name>(args) -> int``, listed in ``_COMMANDS`` below in the order ``--help`` shows them
(``_common`` holds the consoles, ``_command`` that makes a command's parser with the module's
docstring as its description, and the shared flags and converters). This module is the thin
parser: the global options, :func:`build_parser` and :func:`main`. Every command's imports of
the library stay inside its functions, so building the parser imports neither Optuna nor
SQLAlchemy. Exit codes: 0 ok, 1 a runtime failure (DynspecError), 2 a usage or configuration
error (argparse, ConfigError), 130 interrupted.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

from tuner import __version__
from tuner.cli import _bench, _calibrate, _export, _report, _run, _sglang_args, _sim, _sweep
from tuner.cli._common import err_console
from tuner.errors import ConfigError, DynspecError

__all__ = ["main"]

# Each command's parser (its handler is set there as ``func``), in the order --help lists them.
_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _run._add_run,
    _sim._add_sim,
    _calibrate._add_calibrate,
    _report._add_report,
    _export._add_export,
    _bench._add_bench,
    _sweep._add_sweep,
    _sglang_args._add_sglang_args,
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # "-1,3" is a (bad) value, not an option: let it reach the flag's own check.
        self._negative_number_matcher = re.compile(r"^-\d[\d,.]*$")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_global_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--debug, --log-level and --log-format, accepted before or after the command (the
    command's copies default to SUPPRESS so they never undo a value given before it)."""
    from tuner.logging_setup import LOG_FORMATS, LOG_LEVELS

    d = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--debug", action="store_true", default=d(False),
                   help="show tracebacks and debug logs")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=d(None),
                   help="log threshold (default info; debug with --debug)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=d("text"),
                   help="text (default) or json: one JSON object per line on stderr, for "
                   "journald and log shippers")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynspec-tuner",
        description=(
            "Learns, per batch-size bucket, how many speculative draft steps pay on an SGLang "
            "server, and hot-updates the server's per-batch decision."
        ),
        epilog="Try: dynspec-tuner run --simulate   (no GPU, no server needed)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    for p in sub.choices.values():
        _add_global_options(p, top=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a bare command: show what there is to run
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except Exception as exc:  # a flag's converter raised what argparse does not catch
        if "--debug" in argv:
            raise
        err_console.print(f"dynspec-tuner: error: a bad value on the command line "
                          f"({type(exc).__name__}: {exc})", markup=False, soft_wrap=True)
        return 2
    from tuner.logging_setup import configure_logging

    configure_logging(level=args.log_level, fmt=args.log_format, debug=args.debug)
    where = f"dynspec-tuner {args.command}"
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        if args.debug:
            raise
        err_console.print(f"{where}: error: {exc}", markup=False, soft_wrap=True)
        return 2
    except DynspecError as exc:
        if args.debug:
            raise
        err_console.print(f"{where}: {exc}", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        err_console.print("interrupted", markup=False)
        return 130
    except OSError as exc:  # a file, folder, port or address given on the command line
        if args.debug:
            raise
        err_console.print(f"{where}: error: {_os_error(exc)}", markup=False, soft_wrap=True)
        return 2
    except Exception as exc:  # a bug: one line, the traceback with --debug
        if args.debug:
            raise
        err_console.print(
            f"{where}: internal error: {type(exc).__name__}: {exc} (run with --debug for the "
            "traceback, and please report it)", markup=False, soft_wrap=True)
        return 1


def _os_error(exc: OSError) -> str:
    what = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename if exc.filename is not None else None
    return f"{name}: {what}" if name is not None else what
