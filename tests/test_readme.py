"""Every `dynspec-tuner ...` command in the README's shell blocks and in the `docs/` pages it
links still parses (flags and values the CLI accepts), so the front door never shows a command
that errors out at once; the README opens with the two commands and its links resolve."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from tuner.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

RUN_SIMULATE = (
    "python3.11 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/dynspec-tuner run --simulate"
)
RUN_TESTS = (
    "python3.11 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q"
)


def _blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.DOTALL)


def _commands(path: Path) -> list[str]:
    out = []
    for block in _blocks(path.read_text()):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            m = re.search(
                r"(?:^|[;&|(]\s*|^(?:\w+=\S*\s+)+|\.venv/bin/)(dynspec-tuner\s.*)$", line
            )
            if m:
                out.append(m.group(1))
    return out


COMMANDS = [(p.relative_to(ROOT).as_posix(), c) for p in PAGES for c in _commands(p)]


def test_the_pages_have_commands():
    assert len(COMMANDS) >= 20
    assert sum(1 for page, _ in COMMANDS if page == "README.md") >= 4


def test_the_readme_opens_with_the_two_commands():
    blocks = [b.strip() for b in _blocks(README.read_text())]
    assert blocks[:2] == [RUN_SIMULATE, RUN_TESTS]


def test_the_readmes_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing


@functools.cache
def _anchors(page: Path) -> frozenset[str]:
    """The anchors a Markdown renderer gives ``page``'s headings (GitHub's rule)."""
    out: set[str] = set()
    for title in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = 0
        while (anchor := slug if n == 0 else f"{slug}-{n}") in out:
            n += 1
        out.add(anchor)
    return frozenset(out)


def test_links_between_the_pages_land_on_a_heading():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)", page.read_text()):
            dest = (page.parent / target) if target else page
            if not dest.exists() or anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken


@pytest.mark.parametrize(("page", "command"), COMMANDS)
def test_readme_command_parses(page, command):
    cmd = re.split(r"\s+#\s", command)[0]  # a trailing comment
    cmd = re.split(r"\s*(?:\||&&|;|\))\s*", cmd)[0]  # the first command of a pipeline
    argv = shlex.split(cmd)[1:]
    argv = [a for a in argv if "$(" not in a]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{page}: command does not parse ({exc.code}): {command}")
    assert args.func is not None
