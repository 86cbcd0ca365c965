"""Every `dynspec-tuner ...` command in the README's shell blocks still parses (flags and
values the CLI accepts), so the front door never shows a command that errors out at once."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tuner.cli import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"


def _commands() -> list[str]:
    text = README.read_text()
    out = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            m = re.search(r"(?:^|[;&|(]\s*|^(?:\w+=\S*\s+)+)(dynspec-tuner\s.*)$", line)
            if m:
                out.append(m.group(1))
    return out


COMMANDS = _commands()


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_parses(command):
    cmd = re.split(r"\s+#\s", command)[0]  # a trailing comment
    cmd = re.split(r"\s*(?:\||&&|;|\))\s*", cmd)[0]  # the first command of a pipeline
    argv = shlex.split(cmd)[1:]
    argv = [a for a in argv if "$(" not in a]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"README command does not parse ({exc.code}): {command}")
    assert args.func is not None
