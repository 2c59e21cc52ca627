"""The system commands the tests run are the ones ``make test`` installs (issue 40): a test that
adopts a new command without listing it in ``tests/system-tools.txt`` fails here, and the installer
stops with one line, before any test, where it cannot install."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.system_tools import LISTED, listed_tools

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
INSTALLER = TESTS / "install-system-tools"
LOOKUPS = {"system_tool", "listed_system_tool", "which"}
"""Calls whose first argument names a command: our lookups and ``shutil.which``."""
RUNNERS = {"run", "Popen", "check_output", "check_call"}
"""``subprocess`` calls whose literal argv names the command first."""


def _named_commands(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        first = node.args[0]
        if name in RUNNERS and isinstance(first, ast.List) and first.elts:
            first = first.elts[0]
        elif name not in LOOKUPS:
            continue
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.add(first.value)
    return found


def commands_named_by_tests() -> dict[str, list[str]]:
    """``{command: [test files]}`` for every command a test file names literally."""
    named: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for command in _named_commands(ast.parse(path.read_text(), str(path))):
            named.setdefault(command, []).append(str(path.relative_to(ROOT)))
    return named


def test_every_command_a_test_runs_is_listed_or_pip_installed() -> None:
    listed = listed_tools()
    beside_python = Path(sys.executable).parent
    unlisted = {
        command: files
        for command, files in commands_named_by_tests().items()
        if command not in listed and not (beside_python / command).exists()
    }
    assert unlisted == {}, f"add these commands and their Debian packages to {LISTED}"


def test_the_scan_sees_each_way_a_test_names_a_command() -> None:
    """The check above can fail: each spelling it reads is found."""
    source = (
        "system_tool('a')\nshutil.which('b')\nsubprocess.run(['c', '-x'])\n"
        "subprocess.Popen(['d'])\nsubprocess.run([tool, 'e'])\nprint('f')\n"
    )
    assert _named_commands(ast.parse(source)) == {"a", "b", "c", "d"}


def test_every_listed_command_is_installed() -> None:
    """What ``make test`` set up: each listed command is on PATH (the installer's stamp holds)."""
    missing = [command for command in listed_tools() if shutil.which(command) is None]
    assert missing == []


def test_the_installer_names_what_it_cannot_install(tmp_path: Path) -> None:
    """No package manager on PATH: one line naming the command and the install command, exit 1."""
    listing = tmp_path / "tools.txt"
    listing.write_text("# command package\nbash bash\ntierstore-no-such-tool tierstore-pkg why\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command in ("id", "bash"):
        (bin_dir / command).symlink_to(shutil.which(command) or command)
    done = subprocess.run(
        [shutil.which("bash") or "bash", str(INSTALLER), str(listing)],
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "tierstore-no-such-tool" in done.stderr
    assert "apt-get install -y --no-install-recommends tierstore-pkg" in done.stderr
    assert "bash" not in done.stderr.split(";")[0]


def test_the_installer_does_nothing_when_everything_is_there(tmp_path: Path) -> None:
    listing = tmp_path / "tools.txt"
    listing.write_text("bash bash\n")
    done = subprocess.run([str(INSTALLER), str(listing)], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_make_installs_the_tools_before_any_test_lane() -> None:
    """``make test`` sets the tools up first, and every test lane depends on the stamp."""
    rules = {
        line.split(":")[0]: line.split(":", 1)[1].split()
        for line in (ROOT / "Makefile").read_text().splitlines()
        if ":" in line and not line.startswith(("\t", "#", " ")) and "=" not in line.split(":")[0]
    }
    assert rules["test"][0] == "$(TOOLS)"
    for lane in ("unit", "quick", "procs", "s3server", "faults", "soak"):
        assert "$(TOOLS)" in rules[lane], lane
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "make test" in ci
