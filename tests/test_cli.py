"""The ``tierstore`` command: ls (table and JSON), verify (exit 1 on mismatch), restore, one-line errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader

from tests.training import Trainer, assert_same, fresh_target
from tierstore import TieredWriter
from tierstore.cli import main
from tierstore.config import load_config
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


@pytest.fixture
def config_file(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": tier_specs("memory", "local", "s3")}))
    return path


def save(path: Path, checkpoint_id: str, tier: str | None = None) -> None:
    """Save; with ``tier``, the same bytes once more into that tier (a second copy of the id)."""
    trainer = Trainer(seed=0)
    trainer.train(1)
    writer = TieredWriter(str(path), tier=tier, overwrite=tier is not None)
    dcp.save(trainer.state(), storage_writer=writer, checkpoint_id=checkpoint_id)


@pytest.mark.slow  # several seconds of S3 requests: make test runs it, make quick does not
def test_ls_table_and_json(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(config_file), "ls"]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
    save(config_file, "step_000100")
    save(config_file, "step_000200")
    save(config_file, "step_000200", tier="s3")
    assert main(["--config", str(config_file), "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "STEP", "TIERS", "DURABLE", "SIZE", "AGE"]
    assert lines[1].split()[:4] == ["step_000200", "200", "memory,s3", "yes"]
    assert lines[2].split()[:4] == ["step_000100", "100", "memory", "no"]
    assert main(["--config", str(config_file), "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["id"], e["tiers"], e["durable"]) for e in listed] == [
        ("step_000200", ["memory", "s3"], True),
        ("step_000100", ["memory"], False),
    ]
    assert all(e["bytes"] > 0 and "stall_s" in e and "commit_s" in e for e in listed)


@pytest.mark.slow  # several seconds of S3 requests: make test runs it, make quick does not
def test_verify_ok_then_mismatch(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(config_file, "step_000001")
    save(config_file, "step_000001", tier="s3")
    assert main(["--config", str(config_file), "verify", "step_000001"]) == 0
    out = capsys.readouterr().out
    assert "memory: ok" in out and "s3: ok" in out
    config = load_config(config_file)
    s3 = make_tier(config.tier("s3"), namespace="run", node=0)
    entry = next(f for f in read_manifest(s3, "step_000001", trust=MarkerTrust()).files if f.rank == 0)
    raw = bytearray(s3.read_bytes(f"step_000001/{entry.path}"))
    raw[100] ^= 0x40
    s3.write_bytes(f"step_000001/{entry.path}", bytes(raw))
    assert main(["--config", str(config_file), "verify", "step_000001"]) == 1
    out = capsys.readouterr().out
    assert f"s3: MISMATCH step_000001/{entry.path}: CRC32C" in out
    assert "memory: ok" in out


def test_verify_unknown_id_and_bad_id(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(config_file), "verify", "nothing_here"]) == 2
    assert "not committed in any tier" in capsys.readouterr().err
    assert main(["--config", str(config_file), "verify", "../etc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierstore: error: checkpoint id '../etc'") and err.count("\n") == 1


def test_ls_ignores_uncommitted_directories(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(config_file, "step_000001")
    save(config_file, "step_000002")
    config = load_config(config_file)
    make_tier(config.tiers[0], namespace="run", node=0).delete(marker_path("step_000002"))
    assert main(["--config", str(config_file), "ls", "--json"]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["step_000001"]


def test_errors_are_one_line_with_exit_code_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: a, type: tape}\n")
    for args in (["--config", str(bad), "ls"], ["--config", str(tmp_path / "none.yaml"), "ls"]):
        done = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", *args], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2
        assert done.stderr.startswith("tierstore: error: ")
        assert done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_unreachable_s3_endpoint_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "tierstore.yaml"
    path.write_text(
        "tiers:\n  - {name: s3, type: s3, url: 's3://bucket/x', endpoint_url: 'http://127.0.0.1:9',"
        " max_attempts: 1}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(path), "verify", "step_1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2
    assert "tier s3 (s3, s3://bucket/x)" in done.stderr and "cannot reach http://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr


def restore(config_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tierstore restore`` in its own process, as a person would run it."""
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(config_file), "restore", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_restore_json_summary_and_tier_choice(config_file: Path, tmp_path: Path) -> None:
    save(config_file, "step_000001")
    Promoter(load_config(config_file)).run_once()  # the same generation in local and s3 too
    done = restore(config_file, "step_000001", "--to", str(tmp_path / "fast"), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["id"], summary["tier"]) == ("step_000001", "memory")
    exported = list((tmp_path / "fast").iterdir())
    assert summary["files"] == len(exported) and summary["bytes"] == sum(p.stat().st_size for p in exported)
    assert summary["seconds"] >= 0
    done = restore(config_file, "step_000001", "--to", str(tmp_path / "slow"), "--tier", "s3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"restored step_000001 from s3 to {tmp_path / 'slow'}: ")
    expected = Trainer(seed=0)
    expected.train(1)
    target, state = fresh_target()
    dcp.load(state, storage_reader=FileSystemReader(tmp_path / "slow"))
    target.restore(state)
    assert_same(expected.state(), target.state())


def test_restore_errors_name_the_id_and_the_tiers(config_file: Path, tmp_path: Path) -> None:
    done = restore(config_file, "step_000404", "--to", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.startswith(
        "tierstore: error: no tier holds a usable committed copy of checkpoint 'step_000404'"
    )
    assert all(f"{name} (" in done.stderr for name in ("memory", "local", "s3"))
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    done = restore(config_file, "../etc", "--to", str(tmp_path / "out"))
    assert done.returncode == 2 and "checkpoint id '../etc'" in done.stderr
    save(config_file, "step_000001")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    done = restore(config_file, "step_000001", "--to", str(tmp_path / "taken"))
    assert done.returncode == 2 and "exists and is not empty" in done.stderr


def test_restore_of_a_corrupt_copy_exits_1(config_file: Path, tmp_path: Path) -> None:
    save(config_file, "step_000001")
    ram = make_tier(load_config(config_file).tiers[0], namespace="run", node=0)
    entry = next(f for f in read_manifest(ram, "step_000001", trust=MarkerTrust()).files if f.rank == 0)
    raw = bytearray(ram.read_bytes(f"step_000001/{entry.path}"))
    raw[-1] ^= 0x01
    ram.write_bytes(f"step_000001/{entry.path}", bytes(raw))
    done = restore(config_file, "step_000001", "--to", str(tmp_path / "out"))
    assert done.returncode == 1
    assert f"tier memory: step_000001/{entry.path}: CRC32C" in done.stderr
    assert not (tmp_path / "out").exists()


def test_ls_watch_lists_again_until_interrupted(config_file: Path) -> None:
    save(config_file, "step_000001")
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(config_file),
            "ls",
            "--watch",
            "--interval",
            "100ms",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watch.stdout is not None
        lines = [watch.stdout.readline() for _ in range(6)]  # three listings, each after a time line
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, err
    assert [line.startswith("-- ") for line in lines] == [True, False] * 3
    assert all([e["id"] for e in json.loads(line)] == ["step_000001"] for line in lines[1::2])
    assert "Traceback" not in err
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "--config",
            str(config_file),
            "ls",
            "--watch",
            "--interval",
            "0",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2 and "expected a positive interval" in done.stderr
