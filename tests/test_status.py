"""``tierstore status``: tiers against retention and space, the recovery point, mirrors, promoters."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.hung_files import fifo_at, refusing_s3_tier
from tests.training import Trainer
from tierstore import TieredWriter
from tierstore._platform import health
from tierstore.cli import main
from tierstore.cli.status import gather_status
from tierstore.config import load_config
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.records.mirror import MirrorStatus, write_status
from tierstore.records.promoter_state import PromoterState, read_state, write_state
from tierstore.signing import MarkerTrust


@pytest.fixture
def config_file(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    specs = tier_specs("memory", "local", memory={"keep": 2, "mirror": True})
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": specs}))
    return path


def save(path: Path, checkpoint_id: str, steps: int = 1) -> None:
    trainer = Trainer(seed=0)
    trainer.train(steps)
    dcp.save(trainer.state(), storage_writer=TieredWriter(str(path)), checkpoint_id=checkpoint_id)


def status(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["--config", str(path), "status", *extra])
    return code, capsys.readouterr().out


def test_before_any_promoter_runs_status_says_so_and_exits_1(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = status(config_file, capsys)
    assert code == 1
    assert "promoter: node 0 no promoter has run on this node" in out
    assert "recovery point" not in out, "nothing committed: no recovery point to speak of"


def test_after_a_promoter_pass_every_tier_and_the_recovery_point_are_shown(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(config_file, "step_000001")
    save(config_file, "step_000002")
    save(config_file, "step_000003")
    assert Promoter(load_config(config_file)).run(once=True) == 0
    code, out = status(config_file, capsys)
    lines = out.splitlines()
    assert lines[0].split() == ["TIER", "NODE", "STATE", "CHECKPOINTS", "SIZE", "SPACE", "NEWEST", "LAG"]
    memory, local = lines[1].split(), lines[2].split()
    assert memory[:4] == ["memory", "0", "ok", "2/2"], "retention kept 2 of keep 2"
    assert memory[-2] == "step_000003"
    assert local[:4] == ["local", "0", "ok", "3"]
    assert "%)" in lines[1], "the filesystem's space under the tier, with its share used"
    assert "recovery point: step_000003 in the durable tier" in out
    assert "promoter: node 0 ok: last pass" in out and "1 passes" in out
    # A save without a process group makes no mirror exchange, so no record: unknown, no problem.
    assert "mirror: memory node 0: step_000003 unknown (no mirror record yet)" in out
    assert code == 0 and out.rstrip().endswith("problems: none"), out
    report = json.loads(status(config_file, capsys, "--json")[1])
    assert report["durable"]["checkpoint_id"] == "step_000003"
    assert report["recovery_point_lag_s"] >= 0
    by_name = {t["name"]: t for t in report["tiers"]}
    assert by_name["memory"]["checkpoints"] == 2 and by_name["memory"]["keep"] == 2
    assert by_name["local"]["checkpoints"] == 3 and by_name["local"]["durable"] is True
    # Each save's .metadata differs in size by a few bytes (its items' CRC32Cs pickle at 4 or 5).
    saved = sum(read_manifest_bytes(config_file, f"step_00000{n}") for n in (1, 2, 3))
    assert by_name["local"]["bytes"] == saved
    assert 0 < by_name["memory"]["space"]["used"] <= by_name["memory"]["space"]["total"]
    assert report["promoters"][0]["state"]["passes"] == 1
    assert report["ok"] is True and report["problems"] == []


def read_manifest_bytes(path: Path, checkpoint_id: str) -> int:
    config = load_config(path)
    return read_manifest(config.make_tiers(node=0)[-1], checkpoint_id, trust=MarkerTrust()).total_bytes


def test_a_mirror_not_held_and_a_held_one_read_from_the_owners_record(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(config_file, "step_000001")
    assert Promoter(load_config(config_file)).run(once=True) == 0
    memory = load_config(config_file).make_tiers(node=0)[0]
    generation = read_manifest(memory, "step_000001", trust=MarkerTrust()).generation
    write_status(memory, MirrorStatus("step_000001", generation, 0, None, False, "partner away"))
    code, out = status(config_file, capsys)
    assert code == 1
    assert "mirror: memory node 0: step_000001 NOT mirrored (partner away)" in out
    assert "step_000001 has no peer mirror (reduced redundancy): partner away" in out
    write_status(memory, MirrorStatus("step_000001", generation, 0, 1, True))
    code, out = status(config_file, capsys)
    assert "mirror: memory node 0: step_000001 held by node 1" in out
    assert code == 0, out


def test_a_stale_or_failing_promoter_is_a_problem(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = load_config(config_file).make_tiers(node=0)[0]
    old = PromoterState(
        node=0, interval=10, stall_after=300, passes=7, last_error=None, at=time.time() - 1000
    )
    write_state(memory, old)
    code, out = status(config_file, capsys)
    assert code == 1
    assert "promoter of node 0: stuck or stopped: last pass 1000 s ago (bound 300 s)" in out
    failing = PromoterState(
        node=0, interval=10, stall_after=300, passes=7, last_error="tier local: disk full"
    )
    write_state(memory, failing)
    code, out = status(config_file, capsys)
    assert code == 1 and "failing: last pass 0 s ago failed: tier local: disk full" in out


def test_the_promoter_records_each_pass_in_its_node_local_tiers(config_file: Path) -> None:
    config = load_config(config_file)
    promoter = Promoter(config, node=3)
    assert promoter.run(once=True) == 0
    assert promoter.run(once=True) == 0
    for tier in config.make_tiers(node=3):
        state = read_state(tier, 3)
        assert state is not None and state.passes == 2 and state.last_error is None
        assert state.health()[0]
    assert read_state(config.make_tiers(node=0)[0], 3) is None, "node 3's tiers only"


def memory_and_refusing_s3(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    """A configuration file: a memory tier, then an S3 tier whose endpoint refuses every request."""
    path = tmp_path / "tierstore.yaml"
    tiers = [*tier_specs("memory"), refusing_s3_tier()]
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": tiers, "probe_timeout": "2s"}))
    return path


@pytest.fixture
def saved_beside_away_s3(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    """:func:`memory_and_refusing_s3` with ``step_000001`` saved in the memory tier."""
    path = memory_and_refusing_s3(tmp_path, tier_specs)
    save(path, "step_000001")
    return path


def test_an_unreachable_tier_is_reported_within_probe_timeout_and_its_content_unknown(
    saved_beside_away_s3: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = saved_beside_away_s3
    started = time.monotonic()
    report = gather_status(load_config(path), [0])
    assert time.monotonic() - started < 10
    away = next(t for t in report.tiers if t.name == "s3")
    assert not away.reachable and away.node is None and away.error
    code, out = status(path, capsys)
    assert code == 1
    assert re.search(r"^s3\s+-\s+unreachable", out, re.MULTILINE), out
    assert "tier s3 is unreachable" in out
    assert re.search(r"^memory\s+0\s+ok\s+1 ", out, re.MULTILINE), "the other tier is still shown"
    # What an unreachable durable tier holds is unknown, not nothing.
    assert "nothing in the durable tier" not in out
    assert "recovery point: unknown: the durable tier s3 is unreachable" in out, out
    report_json = json.loads(status(path, capsys, "--json")[1])
    assert report_json["durable"] is None and report_json["durable_reachable"] is False


def test_ls_says_durable_unknown_while_the_durable_tier_is_unreachable(
    saved_beside_away_s3: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = saved_beside_away_s3
    assert main(["--config", str(path), "ls"]) == 0
    listed = capsys.readouterr()
    header, row = listed.out.splitlines()[:2]
    assert header.split()[3] == "DURABLE" and row.split()[:4] == ["step_000001", "1", "memory", "?"]
    assert "tier s3 is unreachable, not listed" in listed.err
    assert main(["--config", str(path), "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["durable"] is None, "unknown, not false"


@pytest.mark.parametrize("command", ["ls", "status"])
def test_a_read_only_command_reports_an_unreachable_tier_without_each_retry(
    saved_beside_away_s3: Path,
    command: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    def retries(*flags: str) -> list[str]:
        caplog.clear()
        # each command is a new process, on a node of its own: it finds the tier away itself
        health.view()._forget()
        monkeypatch.setenv("TIERSTORE_HEALTH_DIR", str(tmp_path / uuid.uuid4().hex))
        assert main(["--config", str(saved_beside_away_s3), command, *flags]) in (0, 1)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying s3")]

    assert retries() == [], "the command's own report of the tier is the outcome; attempts are -v"
    left_out = [r for r in caplog.records if "is unreachable, left out" in r.getMessage()]
    assert left_out == [], "the command reports the tier itself: not a second time as a log line"
    assert retries("-v"), "with -v each retry is shown"
    assert retries() == [], "main put the levels back"


def test_nodes_lists_each_nodes_local_tiers_and_promoters(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(config_file, "step_000001")
    assert Promoter(load_config(config_file), node=0).run(once=True) == 0
    report = json.loads(status(config_file, capsys, "--nodes", "0,1", "--json")[1])
    assert [(t["name"], t["node"]) for t in report["tiers"]] == [
        ("memory", 0),
        ("local", 0),
        ("memory", 1),
        ("local", 1),
    ]
    assert [(p["node"], p["ok"]) for p in report["promoters"]] == [(0, True), (1, False)]
    assert report["tiers"][2]["checkpoints"] == 0, "node 1 saved nothing"


def shared_config(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]) -> Path:
    """A local disk and a shared filesystem: tiers that can hang (host memory cannot)."""
    path = tmp_path / "tierstore.yaml"
    specs = tier_specs("local", "shared")
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": specs, "probe_timeout": "1s"}))
    return path


@pytest.mark.slow  # waits out probe timeouts on purpose (4 s): make test runs it, make quick does not
@pytest.mark.timeout(60, method="thread")
def test_a_hung_promoter_record_or_marker_costs_status_and_ls_probe_timeout_not_forever(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = shared_config(tmp_path, tier_specs)
    save(path, "step_000001")
    save(path, "step_000002")
    assert Promoter(load_config(path)).run(once=True) == 0
    shared_root = tmp_path / "shared" / "run"
    with fifo_at(shared_root / "step_000002" / "commit.json"):
        started = time.monotonic()
        assert main(["--config", str(path), "status"]) == 1
        out = capsys.readouterr().out
        assert time.monotonic() - started < 8, "status waited on a hung marker read"
        assert re.search(r"^shared\s+-\s+unreachable", out, re.MULTILINE), out
        assert "read the marker of step_000002 within 1s" in out
        started = time.monotonic()
        assert main(["--config", str(path), "ls"]) == 0
        listed = capsys.readouterr()
        assert time.monotonic() - started < 8, "ls waited on a hung marker read"
        assert "tier shared is unreachable, not listed" in listed.err
        assert ",shared" not in listed.out, "a tier left out is not named as a holder"
    local_root = tmp_path / "local" / "0" / "run"
    with fifo_at(local_root / ".tierstore" / "promoter" / "node00000.json"):
        config = load_config(path)
        started = time.monotonic()
        report = gather_status(config, [0])
        assert time.monotonic() - started < 8, "status waited on a hung promoter record"
        assert not report.promoters[0].ok


def test_read_only_commands_create_and_write_nothing_in_the_tiers(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = shared_config(tmp_path, tier_specs)
    for command in (["status"], ["status", "--json"], ["ls"], ["ls", "--json"]):
        code = main(["--config", str(path), *command])
        assert code in (0, 1), capsys.readouterr().err
    capsys.readouterr()
    assert not (tmp_path / "local").exists() and not (tmp_path / "shared").exists()


def test_status_reports_what_the_promoter_could_not_do(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = load_config(config_file).make_tiers(node=0)[0]
    state = PromoterState(
        node=0,
        interval=10,
        stall_after=300,
        passes=3,
        last_error=None,
        unreachable={"s3": "no answer within 10s"},
        unavailable=("local",),
        failed=("step_000003 memory->local: No space left on device",),
    )
    write_state(memory, state)
    code, out = status(config_file, capsys)
    assert code == 1
    assert "promoter of node 0: tier local refuses writes" in out
    assert "promoter of node 0: could not list tier s3: no answer within 10s" in out
    assert "promoter of node 0: promotion failed: step_000003 memory->local: No space" in out


@pytest.mark.parametrize(
    "change, why",
    [
        ({"at": time.time() + 3600}, "in the future"),
        ({"at": float("nan")}, "malformed"),
        ({"stall_after": float("inf")}, "malformed"),
    ],
)
def test_a_promoter_record_from_the_future_or_not_finite_is_no_sign_of_health(
    config_file: Path, capsys: pytest.CaptureFixture[str], change: dict[str, float], why: str
) -> None:
    memory = load_config(config_file).make_tiers(node=0)[0]
    fields: dict[str, Any] = {
        "node": 0,
        "interval": 10,
        "stall_after": 300,
        "passes": 1,
        "last_error": None,
        **change,
    }
    write_state(memory, PromoterState(**fields))
    code, out = status(config_file, capsys, "--json")
    report = json.loads(out)  # standard JSON: no NaN or Infinity tokens
    assert code == 1 and not report["promoters"][0]["ok"]
    assert why in report["promoters"][0]["why"]


def test_max_lag_makes_an_old_recovery_point_a_problem(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(config_file, "step_000001")
    assert Promoter(load_config(config_file)).run(once=True) == 0
    assert status(config_file, capsys)[0] == 0
    time.sleep(1.2)
    code, out = status(config_file, capsys, "--max-lag", "1s")
    assert code == 1 and "recovery point is" in out and "older than --max-lag 1s" in out


def test_a_full_durable_tier_the_promoter_cannot_write_is_a_problem_in_status(
    small_tmpfs: Path,
    tmp_path: Path,
    tier_specs: Callable[..., list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    specs = tier_specs("memory", "shared", shared={"path": str(small_tmpfs)})
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump({"namespace": "run", "tiers": specs}))
    dcp.save(
        {"w": torch.full((1_000_000,), 1.0)},  # 4 MB: more than the 1 MiB tmpfs holds
        storage_writer=TieredWriter(str(path)),
        checkpoint_id="step_000001",
    )
    assert Promoter(load_config(path)).run(once=True) == 1, "the promotion failed: ENOSPC"
    code, out = status(path, capsys)
    assert code == 1
    assert "promoter of node 0: tier shared refuses writes" in out
    assert "promotion failed: step_000001 memory->shared" in out and "No space left" in out
    assert "no checkpoint is in the durable tier yet" in out


def test_gc_cleans_what_it_can_reach_and_exits_1_naming_a_tier_it_could_not(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    path = memory_and_refusing_s3(tmp_path, tier_specs)
    assert main(["--config", str(path), "gc"]) == 1
    err = capsys.readouterr().err
    assert "tierstore: tier s3 is unreachable, not cleaned:" in err


def test_a_finished_runs_last_checkpoint_not_in_the_durable_tier_is_a_problem(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]
) -> None:
    """``promote.every: 5`` copies only commits 5, 10, ... to the durable tier: a run that ends at
    commit 6 leaves its last state in host memory. While it saves at its pace that is normal; once
    nothing was committed for the run's usual gaps (and ten promoter intervals), it is a problem,
    until the last state is saved durably (what CheckpointManager.close() does)."""
    from tierstore import CheckpointManager

    path = tmp_path / "tierstore.yaml"
    settings = {"namespace": "run", "tiers": tier_specs("memory", "local"), "promote": {"every": 5}}
    path.write_text(yaml.safe_dump(settings))
    state = {"w": torch.zeros(8)}
    manager = CheckpointManager(str(path), state, every_steps=1, async_mode=None)
    for step in range(1, 7):
        state["w"] += 1
        manager.maybe_save(step)
    config = load_config(path)
    assert Promoter(config).run(once=True) == 0
    now = time.time()
    running = gather_status(config, [0], now=now)
    assert running.durable is not None and running.newest is not None
    assert (running.durable.checkpoint_id, running.newest.checkpoint_id) == ("step_00000005", "step_00000006")
    assert running.ok, running.problems()
    later = gather_status(config, [0], now=now + 3600)
    stranded = [p for p in later.problems() if "not in the durable tier" in p]
    assert stranded and stranded[0].startswith(
        "the newest checkpoint step_00000006 is not in the durable tier local"
    )
    assert "its last state is not durable" in stranded[0]
    manager.close(6)
    closed = gather_status(config, [0], now=now + 3600)
    assert closed.durable is not None and closed.durable.checkpoint_id == "step_00000006"
    assert not [p for p in closed.problems() if "not in the durable tier" in p]
