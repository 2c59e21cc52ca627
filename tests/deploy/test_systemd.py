"""deploy/systemd: the promoter unit stops gracefully, is hardened without hiding /dev/shm, and
passes ``systemd-analyze verify``."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from tests.deploy.contract import ALL_INTERFACES, config, node_local_prefixes, parse_tierstore
from tests.deploy.tools import DEPLOY, system_tool
from tierstore.units import parse_duration

UNIT = DEPLOY / "systemd" / "tierstore-promoter.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "promoter.env.example"


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
    result = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, check=False
    )
    # verify exits 0 on unknown keys and bad values too; it only says so: silence is the check.
    assert result.returncode == 0 and (result.stdout + result.stderr).strip() == "", result.stderr
