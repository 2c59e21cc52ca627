"""Clock skew: a promoter or ``gc`` whose clock runs hours ahead or behind never deletes a save in
flight, an upload in flight or a copy being read; a trainer's clock never orders commits.

The skew is real: the skewed actor runs as a process under Debian's ``faketime`` (libfaketime shifts
its ``time.time()``; file times stay those the kernel or the S3 server stamps, as for a host whose
clock is off over a tier it does not stamp). The documented limit is ``activity_ttl / 2`` (30 s by
default, docs/operations.md "Clocks"); every skew here is beyond it. ``.ci/run`` installs faketime, so
a missing one fails these tests instead of skipping them.

Python under libfaketime 0.9.10: with the monotonic clock faked (the default) a timed wait on a lock
or event never times out (it waits on a monotonic deadline years away) though it wakes when
notified; with ``FAKETIME_DONT_FAKE_MONOTONIC=1``, ``time.sleep`` fails with EINVAL. The commands
run here pass under both (``SKEWS``); the skewed trainer keeps the default and waits by polling.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import yaml

from tests.conftest import open_uploads
from tests.guarantees.test_concurrency import assert_audit_clean, loaded, paused_save, state_of
from tests.s3server import SeaweedServer
from tests.system_tools import system_tool
from tierstore import TieredWriter, latest_committed
from tierstore.cli import main
from tierstore.cli.audit import audit_all
from tierstore.config import Config, config_from_dict
from tierstore.ids import CLOCK_DIR, PROMOTER_DIR, generation_dir
from tierstore.promote.sidecar import Promoter
from tierstore.records.activity import held
from tierstore.records.marker import read_manifest
from tierstore.records.promoter_state import read_state
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

SKEWS = [
    ("promote", "+2h", False),
    ("gc", "+2h", True),
    ("promote", "-2h", True),
    ("gc", "-2h", False),
    ("promote", "+90s", True),
    ("gc", "-90s", False),
    ("gc", "+1d", False),
]
"""``(command, faketime offset, real monotonic clock)``: both directions, both commands, every
offset beyond the limit; libfaketime's monotonic clock faked and not."""
REAL_S3_SKEWS = [
    ("promote", "+10m", False),
    ("gc", "-10m", True),
    ("promote", "-90s", True),
    ("gc", "+90s", False),
    ("promote", "+2h", False),
    ("gc", "-2h", True),
]
"""A real S3 server refuses requests signed more than 15 minutes from its time
(``RequestTimeTooSkewed``): beyond that the tier is unreachable to the skewed promoter, which
deletes nothing there and fails."""
S3_SIGNING_SKEW = 15 * 60
BESIDE_TRAINERS = [("promote", "+0s"), ("gc", "+0s"), ("promote", "+2h"), ("gc", "-1d")]
"""The promoters that run while a trainer two hours behind holds a save in flight."""
SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def faketime() -> str:
    """The ``faketime`` wrapper; a missing one fails (``make test`` installs it)."""
    return system_tool("faketime")


def offset_seconds(offset: str) -> float:
    """``+2h`` -> 7200.0."""
    return float(offset[:-1]) * SECONDS[offset[-1]]


def run_skewed(
    offset: str, argv: list[str], *, real_monotonic: bool, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with its clock moved by ``offset`` (``FAKETIME_DONT_FAKE_MONOTONIC``: only
    the wall clock moves; otherwise libfaketime moves the monotonic clock too)."""
    env = {k: v for k, v in os.environ.items() if k != "FAKETIME_DONT_FAKE_MONOTONIC"}
    if real_monotonic:
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    return subprocess.run(
        [faketime(), "-f", offset, *argv],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def cli(config_path: Path, command: str, offset: str, *, real_monotonic: bool, refused: bool = False) -> str:
    """``tierstore --config F promote --once`` or ``gc``, on a skewed clock; its output.
    ``refused``: S3 refuses its requests (signed too far from the server's time): it says so, and
    both fail (``gc`` names the tier it could not reach and exits 1)."""
    argv = [sys.executable, "-m", "tierstore.cli", "--config", str(config_path), command]
    argv += ["--once"] if command == "promote" else []
    done = run_skewed(offset, argv, real_monotonic=real_monotonic)
    said = f"{command} at {offset}: {done.stdout}{done.stderr}"
    assert ("RequestTimeTooSkewed" in said) is refused, said
    assert done.returncode != 0 if refused else done.returncode == 0, said
    return said


def save(config: Config, checkpoint_id: str, value: float) -> None:
    dcp.save(state_of(value), storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def write_config(tmp_path: Path, specs: list[dict[str, Any]]) -> tuple[Config, Path]:
    data = {"tiers": specs}
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump(data))
    return config_from_dict(data), path


def files_of(tier: Tier) -> dict[str, int]:
    """Every file in the tier with its size, but the records a pass leaves about itself."""
    return {
        f.path: f.size for f in tier.find("") if not f.path.startswith((f"{CLOCK_DIR}/", f"{PROMOTER_DIR}/"))
    }


@contextlib.contextmanager
def upload_in_flight(tier: Tier, path: str) -> Iterator[None]:
    """A straggler's multipart upload into ``path``: one part sent, the rest still due. When the
    block ends the straggler gives up (the tier discards the upload: nothing under the name)."""
    finish = threading.Event()

    def write() -> None:
        with contextlib.suppress(RuntimeError), tier.open_write(path) as stream:
            stream.write(b"x" * (6 * 2**20))  # more than one 5 MiB part: a multipart upload
            finish.wait(120)
            raise RuntimeError("the straggler gives up")

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while path not in open_uploads(tier):
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.05)
    try:
        yield
    finally:
        finish.set()
        thread.join(60)


def test_faketime_moves_python_wall_clock_not_file_times(tmp_path: Path) -> None:
    """What the tests below rely on: under faketime, ``time.time()`` moves; the times the kernel
    stamps on files do not (Python's ``os.stat`` is not faked), as for a host whose clock is off
    over a tier that another clock stamps. The monotonic clock moves too unless
    ``FAKETIME_DONT_FAKE_MONOTONIC=1``: tierstore compares monotonic readings within one process
    only, so either way it is a clock that does not go back."""
    probe = tmp_path / "probe"
    script = (
        "import os, sys, time; open(sys.argv[1], 'w').close(); a, w = time.monotonic(), time.time()\n"
        "while time.time() - w < 0.2: pass\n"
        "print(time.time(), os.stat(sys.argv[1]).st_mtime, a, time.monotonic() - a)"
    )
    for real_monotonic in (False, True):
        wall, mono = time.time(), time.monotonic()
        done = run_skewed("+2h", [sys.executable, "-c", script, str(probe)], real_monotonic=real_monotonic)
        assert done.returncode == 0, done.stderr
        fake_wall, mtime, fake_mono, elapsed = map(float, done.stdout.split())
        assert abs(fake_wall - wall - 7200) < 60, "time.time() runs two hours ahead"
        assert abs(mtime - wall) < 60, "the file's time is the kernel's, not the skewed clock"
        assert 0.15 < elapsed < 5, "the monotonic clock advances at the normal rate"
        moved = abs(fake_mono - mono) > 3600
        assert moved is not real_monotonic, (
            f"FAKETIME_DONT_FAKE_MONOTONIC={int(real_monotonic)}: monotonic {fake_mono} vs {mono}"
        )


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_a_skewed_promoter_or_gc_never_deletes_work_in_flight_or_a_copy_being_read(
    kind: str, tier_specs: Callable[..., list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A save paused before its marker (its write record refreshed by the heartbeat), in S3 a rank's
    multipart upload still open, and a restore reading an older copy that retention (keep: 1) no
    longer keeps: ``promote --once`` and ``gc`` running hours or a day ahead or behind delete none of
    it, while the record each promoter leaves shows its clock was off."""
    skewed_promoters_leave_work_in_flight(tmp_path, tier_specs(kind, **{kind: {"keep": 1}}), SKEWS)


def test_on_a_real_s3_server_a_skewed_promoter_deletes_nothing_in_flight(
    seaweed: SeaweedServer, seaweed_bucket: str, tmp_path: Path
) -> None:
    """The same against SeaweedFS: its own clock stamps ``LastModified`` and the uploads' start;
    beyond 15 minutes it refuses the skewed promoter's requests (which then deletes nothing)."""
    spec = {
        "name": "s3",
        "type": "s3",
        "url": f"s3://{seaweed_bucket}/ckpt",
        "keep": 1,
        "endpoint_url": seaweed.endpoint,
        "max_attempts": 3,
        "part_size": "5MiB",
    }
    skewed_promoters_leave_work_in_flight(tmp_path, [spec], REAL_S3_SKEWS, signed=True)


def skewed_promoters_leave_work_in_flight(
    tmp_path: Path, specs: list[dict[str, Any]], skews: list[tuple[str, str, bool]], *, signed: bool = False
) -> None:
    """The scenario of the two tests above, over one tier with ``keep: 1``; ``signed``: the server
    checks request times (see :data:`REAL_S3_SKEWS`)."""
    config, path = write_config(tmp_path, specs)
    (tier,) = config.make_tiers(node=0)
    for step in (1, 2):
        save(config, f"step_{step:06d}", float(step))
    ttl = config.promote.activity_ttl
    with (
        ThreadPoolExecutor(1) as pool,
        held(tier, "read", "step_000001", None, ttl=ttl),  # a restore reading step 1
    ):
        pause, done = paused_save(pool, config, "step_000003", 3.0)
        try:
            (generation,) = tier.list_dir("step_000003")
            straggler = f"{generation_dir('step_000003', generation)}/r00001-0.distcp"
            s3 = tier.type == "s3"
            with upload_in_flight(tier, straggler) if s3 else contextlib.nullcontext():
                before = files_of(tier)
                for command, offset, real_monotonic in skews:
                    refused = signed and abs(offset_seconds(offset)) > S3_SIGNING_SKEW
                    said = cli(path, command, offset, real_monotonic=real_monotonic, refused=refused)
                    now = files_of(tier)
                    gone = sorted(p for p in before if now.get(p) != before[p])
                    assert gone == [], f"{command} at {offset} removed work in flight: {said}"
                    if s3:
                        assert straggler in open_uploads(tier), f"{command} at {offset}: {said}"
                    if command == "promote" and not refused:  # its state record: its clock
                        state = read_state(tier, 0)
                        assert state is not None
                        assert abs(state.at - time.time() - offset_seconds(offset)) < 120
        finally:
            pause.go.set()
        done.result()
        assert loaded(config, "step_000001") == 1.0, "the copy being read is whole"
    assert latest_committed(config) == "step_000003"
    assert loaded(config, "step_000003") == 3.0
    assert_audit_clean(config)
    # With the read over, retention on a true clock does its job: nothing was merely frozen.
    Promoter(config).run_once()
    assert [a.checkpoint_id for a in audit_all(config, [0])] == ["step_000003"]


def trainer(config_path: Path, offset: str, *actions: str) -> subprocess.Popen[str]:
    """A trainer process (:mod:`tests.guarantees.skewed_trainer`) whose clock is ``offset`` off."""
    argv = [sys.executable, "-m", "tests.guarantees.skewed_trainer", str(config_path), *actions]
    return subprocess.Popen(
        [faketime(), "-f", offset, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],  # where `tests` imports from
    )


def finished(process: subprocess.Popen[str]) -> None:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out


def test_a_skewed_trainer_orders_nothing_and_loses_nothing(
    tier_specs: Callable[..., list[dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trainers two hours ahead and two hours behind save, overwrite and pause a save in flight
    while promoters on a true clock and two hours ahead run: the newest is the last commit (the
    overwrite by the trainer whose clock reads earliest, its generation named four hours before
    the one it replaces), promotion lets it replace the older copy below, and nothing in flight
    is deleted."""
    config, path = write_config(tmp_path, tier_specs("memory", "local"))
    memory, local = config.make_tiers(node=0)
    save(config, "step_000001", 1.0)
    finished(trainer(path, "+2h", "save:step_000002:2"))
    original = read_manifest(memory, "step_000002", trust=MarkerTrust()).generation
    behind = trainer(path, "-2h", "save:step_000003:3", "pause:step_000004:4", "overwrite:step_000002:22")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "reached").exists():
            assert behind.poll() is None and time.monotonic() < deadline, "no pause reached"
            time.sleep(0.05)
        committed_at = read_manifest(memory, "step_000003", trust=MarkerTrust()).committed_at
        assert abs(committed_at - (time.time() - 7200)) < 120, "the trainer's clock is 2 h behind"
        before = files_of(memory)
        for command, offset in BESIDE_TRAINERS:
            said = cli(path, command, offset, real_monotonic=False)
            now = files_of(memory)
            gone = sorted(p for p in before if now.get(p) != before[p])
            assert gone == [], f"{command} at {offset} removed work in flight: {said}"
    finally:
        (tmp_path / "go").touch()
    finished(behind)
    cli(path, "promote", "+0s", real_monotonic=False)
    assert latest_committed(config) == "step_000002", "the last commit is the newest"
    assert loaded(config, "step_000002") == 22.0
    assert main(["--config", str(path), "ls", "--json"]) == 0
    listed = [entry["id"] for entry in json.loads(capsys.readouterr().out)]
    assert listed == ["step_000002", "step_000004", "step_000003", "step_000001"]
    overwrite = read_manifest(memory, "step_000002", trust=MarkerTrust())
    assert overwrite.generation < original, "the overwrite's name carries the earlier clock"
    assert read_manifest(local, "step_000002", trust=MarkerTrust()).generation == overwrite.generation
    assert_audit_clean(config)


@pytest.mark.parametrize("offset", ["-2h", "+2h"])
def test_what_a_skewed_trainer_knows_of_other_tiers_is_ordered_without_its_clock(
    offset: str, tier_specs: Callable[..., list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A save believes the newer of the promoter's sighting of a tier and its own look there or
    commit there; which is newer must not come from comparing the promoter's clock with its own.

    ``a`` is promoted to ``local`` (the promoter's sighting of local in memory names it), then
    dropped from both tiers by an operator. A trainer on a skewed clock saves ``a`` (its start-up
    look, newer than the sighting, finds ``a`` nowhere: it commits), then ``final`` straight into
    ``local``, then ``final`` again (its own commit is newer than the sighting: refused)."""
    config, path = write_config(tmp_path, tier_specs("memory", "local"))
    save(config, "a", 1.0)
    cli(path, "promote", "+0s", real_monotonic=False)
    for tier in ("local", "memory"):
        assert main(["--config", str(path), "drop", "a", "--tier", tier]) == 0
    finished(trainer(path, offset, "save:a:4", "save:final:5:local", "refused:final:6"))
    assert loaded(config, "a") == 4.0
    assert loaded(config, "final") == 5.0
