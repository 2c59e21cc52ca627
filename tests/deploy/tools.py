"""Where the deploy tests find their tools: pip-installed validators always, system tools if present."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.system_tools import system_tool as listed_system_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def pip_tool(name: str) -> str:
    """A tool installed by ``pip install -e '.[dev]'`` (next to this Python, or on PATH). Never
    skipped: a missing one is a broken set-up, so the test fails."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is missing: `make test` installs it with the dev extra (pyproject.toml)"
    return found


def system_tool(name: str, why: str) -> str:
    """A system command (kubectl, systemd-analyze, promtool) that ``make test`` installs; a missing
    one fails the test, naming what it would have checked (``why``), never skips it."""
    try:
        return listed_system_tool(name)
    except AssertionError as missing:
        raise AssertionError(f"{missing}; {why} cannot be checked") from None


def assert_shellcheck_clean(script: Path) -> None:
    """shellcheck finds nothing in ``script`` (bash; the files it sources are followed)."""
    result = subprocess.run(
        [pip_tool("shellcheck"), "--shell=bash", "--external-sources", str(script)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout
