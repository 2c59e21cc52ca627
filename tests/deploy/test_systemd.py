"""deploy/systemd: the promoter unit stops gracefully, does not restart on a configuration error,
is hardened without hiding /dev/shm, passes ``systemd-analyze verify``, and its install steps create
the user it runs as and the memory tier's directory."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.contract import ALL_INTERFACES, config, node_local_prefixes, parse_tierstore
from tests.deploy.tools import DEPLOY, system_tool
from tierstore.cli import EXIT_ERROR
from tierstore.units import parse_duration

SYSTEMD = DEPLOY / "systemd"
UNIT = SYSTEMD / "tierstore-promoter.service"
ENV_EXAMPLE = SYSTEMD / "promoter.env.example"
SYSUSERS = SYSTEMD / "tierstore-sysusers.conf"
TMPFILES = SYSTEMD / "tierstore-tmpfiles.conf"


def settings() -> dict[str, str]:
    """``Key=value`` of the [Service] section (each key once in this unit)."""
    found: dict[str, str] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            assert key not in found, f"{key} set twice"
            found[key] = value
    return found


def unit_section() -> dict[str, list[str]]:
    """``Key=value`` of the [Unit] section, every value of each key (they accumulate)."""
    found: dict[str, list[str]] = {}
    head = UNIT.read_text().split("[Unit]", 1)[1].split("[Service]", 1)[0]
    for line in head.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found.setdefault(key, []).extend(value.split())
    return found


def test_the_promoter_starts_after_the_mounts_its_tiers_live_on() -> None:
    """A promoter started before its NVMe or a network file system is mounted would write into the
    empty mount point on the root disk (or, under ProtectSystem=strict, fail with exit 2, which is
    never restarted)."""
    unit = unit_section()
    assert "remote-fs.target" in unit["After"], "a shared tier on NFS, Lustre or GPFS"
    assert set(node_local_prefixes().values()) <= set(unit["RequiresMountsFor"])


def test_execstart_is_a_tierstore_promoter_others_can_scrape() -> None:
    argv = shlex.split(settings()["ExecStart"])
    assert Path(argv[0]).name == "tierstore"
    args = parse_tierstore(argv[1:])
    assert args.command == "promote" and not args.once
    assert args.metrics_addr == ALL_INTERFACES
    assert args.config == "/etc/tierstore/tierstore.yaml"


def test_stop_is_graceful_within_the_promoters_grace_period() -> None:
    unit = settings()
    assert unit["KillSignal"] == "SIGTERM"
    assert unit["Restart"] == "on-failure"  # SIGTERM exits 0: a stop is not restarted
    assert parse_duration(unit["TimeoutStopSec"]) > config().promote.grace_period


def test_hardening_keeps_dev_shm_shared_and_the_tiers_writable() -> None:
    unit = settings()
    assert unit["NoNewPrivileges"] == "yes" and unit["ProtectSystem"] == "strict"
    assert unit["PrivateTmp"] == "yes" and unit["ProtectHome"] == "yes"
    # PrivateDevices gives the service its own /dev/shm; DynamicUser and RemoveIPC delete the
    # user's POSIX shared memory (files in /dev/shm) on stop: each would lose the memory tier.
    assert unit.get("PrivateDevices", "no") == "no"
    assert unit.get("RemoveIPC", "no") == "no" and "DynamicUser" not in unit
    writable = {p.lstrip("-") for p in unit["ReadWritePaths"].split()}
    writable |= {f"/var/lib/{d}" for d in unit.get("StateDirectory", "").split()}
    assert set(node_local_prefixes().values()) <= writable


def test_the_env_file_is_an_example_without_credentials() -> None:
    values = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert values["TIERSTORE_NODE"].isdigit()
    assert values["AWS_ACCESS_KEY_ID"] == values["AWS_SECRET_ACCESS_KEY"] == "REPLACE-ME"
    assert settings()["EnvironmentFile"].endswith("promoter.env")


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    analyze = system_tool("systemd-analyze", "the unit's syntax and settings are")
    # verify insists that ExecStart's binary exists; tierstore is not installed at
    # /usr/local/bin here, so a temporary copy points at this Python instead (same unit otherwise).
    text = UNIT.read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("ExecStart=")]
    binary = line.removeprefix("ExecStart=").split()[0]
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(f"ExecStart={binary}", f"ExecStart={sys.executable}"))
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, check=False)
    # verify exits 0 on unknown keys and bad values too; it only says so: silence is the check.
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stderr


def test_a_configuration_error_is_not_restarted() -> None:
    unit = settings()
    assert unit["Restart"] == "on-failure"
    # tierstore exits 2 on a bad configuration or a metrics port in use: a restart cannot cure it.
    assert str(EXIT_ERROR) in unit["RestartPreventExitStatus"].split()
    section = UNIT.read_text().split("[Service]")[0]
    assert re.search(r"^StartLimitBurst=\d+$", section, re.MULTILINE), "other failures stop too"


def install_steps() -> list[list[str]]:
    """The install commands in the unit's header comment, as argv."""
    header = UNIT.read_text().split("[Unit]")[0]
    return [
        shlex.split(line.removeprefix("#").split("#")[0])
        for line in header.splitlines()
        if line.startswith("#   ")
    ]


def test_the_install_steps_install_every_file_and_create_the_user_first() -> None:
    steps = install_steps()
    installed = {Path(step[-2]).name: step[-1] for step in steps if step[0] == "install"}
    shipped = {p.name for p in SYSTEMD.iterdir()} | {"tierstore.yaml"}
    assert set(installed) == shipped, "every file in deploy/systemd is installed"
    assert installed[SYSUSERS.name] == "/etc/sysusers.d/tierstore.conf"
    assert installed[TMPFILES.name] == "/etc/tmpfiles.d/tierstore.conf"
    assert installed[ENV_EXAMPLE.name] == settings()["EnvironmentFile"]
    commands = [step[0] for step in steps]
    assert ["systemd-sysusers", "/etc/sysusers.d/tierstore.conf"] in steps
    assert ["systemd-tmpfiles", "--create", "/etc/tmpfiles.d/tierstore.conf"] in steps
    # The user exists before the unit starts (else: status 217/USER).
    assert commands.index("systemd-sysusers") < commands.index("systemctl")


def sysusers_root(tmp_path: Path) -> tuple[Path, dict[str, list[str]], dict[str, list[str]]]:
    """A root directory after ``systemd-sysusers --root`` with our file; its passwd and group."""
    sysusers = system_tool("systemd-sysusers", "the sysusers.d file")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(SYSUSERS)], check=True, capture_output=True)

    def table(name: str) -> dict[str, list[str]]:
        rows = (root / "etc" / name).read_text().splitlines()
        return {row.split(":")[0]: row.split(":") for row in rows}

    return root, table("passwd"), table("group")


def test_sysusers_creates_the_user_and_group_the_unit_runs_as(tmp_path: Path) -> None:
    _, users, groups = sysusers_root(tmp_path)
    unit = settings()
    user, group = users[unit["User"]], groups[unit["Group"]]
    assert user[2] != "0" and user[3] == group[2], "a system user whose own group is Group="
    assert user[6].endswith("nologin")


def test_tmpfiles_creates_the_memory_tier_directory_for_that_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles can set an owner as root only: not checked")
    tmpfiles = system_tool("systemd-tmpfiles", "the tmpfiles.d file")
    root, users, _ = sysusers_root(tmp_path)
    subprocess.run([tmpfiles, f"--root={root}", "--create", str(TMPFILES)], check=True, capture_output=True)
    memory = node_local_prefixes()["memory"]
    made = (root / memory.lstrip("/")).stat()
    user = users[settings()["User"]]
    assert (made.st_uid, made.st_gid) == (int(user[2]), int(user[3]))
    assert made.st_mode & 0o777 == 0o750
