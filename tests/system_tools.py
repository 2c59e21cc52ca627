"""Where a test finds a system command (faketime, fiu-run, promtool, ...): the one lookup every test
uses, so that ``tests/system-tools.txt``, the list ``make test`` installs from, cannot fall behind."""

from __future__ import annotations

import shutil
from pathlib import Path

LISTED = Path(__file__).with_name("system-tools.txt")


def listed_tools() -> dict[str, str]:
    """``{command: Debian package}`` from ``tests/system-tools.txt``."""
    tools: dict[str, str] = {}
    for line in LISTED.read_text().splitlines():
        words = line.split()
        if words and not words[0].startswith("#"):
            tools[words[0]] = words[1]
    return tools


def system_tool(name: str) -> str:
    """The path of the system command ``name``. A command missing from the list is a test's bug, a
    command missing from the machine a broken set-up: both fail the test, neither skips it."""
    package = listed_tools().get(name)
    assert package is not None, f"{name} is not listed in {LISTED}: add it with its Debian package"
    found = shutil.which(name)
    assert found, (
        f"{name} is missing: `make test` installs it (tests/install-system-tools; as root,"
        f" or run `apt-get install -y {package}` once)"
    )
    return found
