"""Process crashes at named kill points and at random times (issue 24, item 1).

Every kill point of :data:`tierstore._platform.killpoints.KILL_POINTS` is armed once, through
``TIERSTORE_KILL_POINT``, in the real actor that reaches it, run as its own process: the 2-rank
trainer (``kill_child.py``: torch.multiprocessing, gloo on loopback), ``tierstore promote --once``
into a POSIX tier or into S3 (moto's server, 5 MiB parts, so a file is a multipart upload of three
parts) and ``tierstore gc``. Each must die by SIGKILL at that point: a point never reached fails
the case. Then the oracle (``kill_oracle.py``), right after the kill and again after recovery (the
trainer resumed, the promoter restarted, gc run once the dead holder's activity record expired):
restore yields the last committed checkpoint bit-exact, ``verify --all`` is clean, no multipart
upload is left and no byte is leaked. The random sweeps (marker ``faults``; ``make faults`` runs
``TIERSTORE_FAULT_SEEDS`` seeds) SIGKILL the same actors at a seeded random time instead.

Each test prints ``K of K kill points x R seeds survived``, the orphaned uploads and the bytes
leaked after recovery.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.guarantees.kill_child import job_state
from tests.guarantees.kill_oracle import (
    assert_audit_clean,
    assert_restores,
    leaked_bytes,
    only_tier,
    open_upload_count,
)
from tests.seeds import SEEDS_VARIABLE, fault_seeds
from tierstore import TieredWriter, latest_committed
from tierstore._platform.killpoints import KILL_POINTS, VARIABLE
from tierstore.cli import main as cli_main
from tierstore.config import Config, config_from_dict
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

CHILD = Path(__file__).with_name("kill_child.py")
TTL = 1.0
"""``promote.activity_ttl`` (its floor): a dead holder's record is ignored after it, gone after 2x."""
STALE = 0.5
"""``promote.stale_after``: leftovers are removed once this old."""
EXPIRED = 2 * TTL + 0.3
"""The wait after the kills before recovery: every dead holder's activity record has expired."""


Recovery = Callable[[], None]
"""What is left of a recovery once the dead holders' activity records expired."""


@dataclass(frozen=True)
class Case:
    """One kill point armed in one actor. ``spec`` is ``TIERSTORE_KILL_POINT``'s value;
    ``committed``: the trainer's ``step_2`` is committed when it dies there (the marker stands);
    ``target``: the tier a promotion goes to."""

    spec: str
    committed: bool = False
    target: str = "shared"
    big: bool = False
    """Checkpoints of several chunks (S3: parts): a kill mid-copy, mid-upload."""
    upload_open: bool = False
    """The kill leaves a multipart upload open (two parts of three handed to it)."""

    @property
    def point(self) -> str:
        return self.spec.split("@")[0].split(":")[0]


TRAINER = [
    Case("writer.planned:2"),
    Case("writer.mid_file:3"),  # two tensors a rank a save: the first one of step_2's file
    Case("writer.data_written:2"),
    Case("writer.metadata_written:2"),
    Case("writer.committed:2", committed=True),
]
TRAINER_MARKER = [
    Case("marker.files_checked:2"),
    Case("marker.published:2", committed=True),
    Case("marker.rechecked:2", committed=True),
    Case("posix.publish.temp_synced@commit.json:2"),
    Case("posix.publish.linked@commit.json:2", committed=True),
]
"""The marker's publish as the trainer reaches it (``make faults``; ``make test`` arms these in
the promoter, whose publish is the same code)."""
PROMOTER = [
    Case("marker.files_checked"),
    Case("marker.published"),
    Case("marker.rechecked"),
    Case("posix.publish.temp_synced@commit.json"),
    Case("posix.publish.linked@commit.json"),
    Case("promote.mid_copy@r00000-0.distcp", big=True),  # 8 MiB of the 12 MiB file
    Case("promote.data_copied"),
    Case("promote.committed"),
    Case("promote.mid_copy@r00000-0.distcp:2", target="s3", big=True, upload_open=True),
    Case("promote.data_copied", target="s3"),  # between data and marker
    Case("marker.published", target="s3"),
    Case("protocol.effect@PutEntry"),  # the marker stands, its log entry not yet written
]
GC = [
    Case("drop.marker_withdrawn"),
    Case("drop.records_dropped"),
    Case("protocol.effect@DeleteData"),  # marker, entries and parts gone; the data still there
    Case("retention.decided"),  # decided, nothing deleted yet
    Case("retention.between_deletes"),
    Case("cleanup.between_removals"),
]


@dataclass
class Tally:
    """What a test reports: cases survived, uploads left and bytes leaked after recovery."""

    points: set[str] = field(default_factory=set)
    cases: int = 0
    uploads: int = 0
    leaked: int = 0

    def add(self, point: str, uploads: int, leaked: int) -> None:
        self.points.add(point)
        self.cases += 1
        self.uploads += uploads
        self.leaked += leaked

    def report(self, what: str, seeds: int = 1) -> None:
        print(
            f"\n{what}: {len(self.points)} of {len(self.points)} kill points x {seeds} seeds"
            f" survived ({self.cases} cases); orphaned multipart uploads after recovery:"
            f" {self.uploads}; bytes leaked: {self.leaked}"
        )


def write_config(root: Path, target: str, s3: tuple[str, str] | None, **tier: Any) -> Path:
    """A memory tier (node-local, ``{node}``) and the promotion target, ``shared`` or ``s3``."""
    memory = {"name": "memory", "type": "memory", "path": f"{root}/memory/{{node}}", **tier.get("memory", {})}
    if target == "s3":
        assert s3 is not None
        endpoint, bucket = s3
        second = {
            "name": "s3",
            "type": "s3",
            "url": f"s3://{bucket}/ckpt",
            "endpoint_url": endpoint,
            "max_attempts": 3,
            "part_size": "5MiB",
        }
    else:
        second = {"name": "shared", "type": "shared", "path": f"{root}/shared"}
    data = {
        "tiers": [memory, second],
        "promote": {"activity_ttl": TTL, "stale_after": STALE, "interval": 1.0},
    }
    path = root / f"tierstore-{uuid.uuid4().hex[:6]}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def load(path: Path) -> Config:
    return config_from_dict(yaml.safe_load(path.read_text()))


def big_state(step: int) -> dict[str, Any]:
    """About 12 MiB in one data file: three 5 MiB parts into S3, two 8 MiB chunks into POSIX."""
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=generator), "blob": bytes([step]) * 4096}


def small_state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 14, generator=generator), "blob": bytes([step]) * 512}


def save(config: Config, step: int, state: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id=f"step_{step}")


def assert_killed_at(code: int, stderr: str, case: Case, *, by_mp: bool) -> None:
    """The process died by SIGKILL, at ``case``'s point (it said so just before)."""
    said = f"{case.spec}: exit {code}; stderr: {stderr[-3000:]}"
    assert f"tierstore: kill point {case.point} reached" in stderr, f"not reached: {said}"
    if by_mp:  # torch.multiprocessing saw its rank die by the signal and exits 1
        assert code == 1 and "terminated with signal SIGKILL" in stderr, said
    else:
        assert code == -signal.SIGKILL, said


def run_trainers(jobs: list[tuple[Path, Case]], directory: Path) -> list[tuple[int, str]]:
    """Run the trainer (steps 1 and 2, ``dcp.save``) once for each ``(config, case)``, each armed
    with its case's kill point, in processes forked from one that imported torch
    (``kill_child.py batch``); each job's exit code and output."""
    rows = [
        [
            str(path),
            "1",
            "2",
            "sync",
            str(path.parent / f"store-{uuid.uuid4().hex[:8]}"),
            case.spec,
            str(path.parent / "trainer.log"),
        ]
        for path, case in jobs
    ]
    jobs_file = directory / "jobs.json"
    jobs_file.write_text(json.dumps(rows))
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    done = subprocess.run(
        [sys.executable, str(CHILD), "batch", str(jobs_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ended = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(ended) == len(jobs), done.stdout
    return [(os.waitstatus_to_exitcode(e["status"]), Path(e["log"]).read_text()) for e in ended]


def cli_argv(config: Path, command: str) -> list[str]:
    extra = ["--once"] if command == "promote" else []
    return [sys.executable, "-m", "tierstore.cli", "--config", str(config), command, *extra]


def run_cli(config: Path, command: str, spec: str) -> tuple[int, str]:
    """``tierstore promote --once`` or ``gc`` armed with ``spec``: its exit code and stderr."""
    env = {**os.environ, VARIABLE: spec}
    done = subprocess.run(
        cli_argv(config, command), env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return done.returncode, done.stderr


def gc(config: Path) -> None:
    """``tierstore gc``, in this process (recovery)."""
    assert cli_main(["--config", str(config), "-q", "gc"]) == 0


def recovered(config: Config, s3: Any, tally: Tally, point: str) -> None:
    """The oracle after recovery: verify clean, no upload, no byte leaked."""
    assert_audit_clean(config)
    uploads, _ = open_upload_count(config, s3)
    leak, what = leaked_bytes(config, s3)
    assert uploads == 0, f"{point}: {uploads} multipart uploads left after recovery"
    assert leak == 0, f"{point}: {leak} bytes leaked after recovery: {what}"
    tally.add(point, uploads, leak)


# -- the trainer ---------------------------------------------------------------------------------


def trainer_killed(path: Path, case: Case, code: int, output: str) -> Config:
    """The trainer died at ``case`` while it saved ``step_2``: check what is committed."""
    assert_killed_at(code, output, case, by_mp=True)
    config = load(path)
    expected = 2 if case.committed else 1
    assert latest_committed(config, collective=False) == f"step_{expected}", case.spec
    assert_restores(config, f"step_{expected}", job_state(expected))
    assert_audit_clean(config)
    return config


def trainer_resumed(path: Path, config: Config, s3: Any, tally: Tally, point: str) -> Recovery:
    """Resume at once, while the dead save's activity record still looks live: one process saves
    the step after the last commit (the id the dead save was writing, if it did not commit).
    Returns the rest of the recovery: gc once the record expired, then the oracle."""
    latest = latest_committed(config, collective=False)
    assert latest is not None
    step = int(latest.split("_")[1]) + 1
    save(config, step, job_state(step))
    assert latest_committed(config, collective=False) == f"step_{step}"

    def cleaned() -> None:
        gc(path)
        assert latest_committed(config, collective=False) == f"step_{step}"
        assert_restores(config, f"step_{step}", job_state(step))
        recovered(config, s3, tally, point)

    return cleaned


def check_trainer_cases(tmp_path: Path, cases: list[Case], s3: Any) -> Tally:
    paths = [write_config(tmp_path / f"t{i}", "shared", None) for i in range(len(cases))]
    ended = run_trainers(list(zip(paths, cases, strict=True)), tmp_path)
    tally = Tally()
    recoveries = [
        trainer_resumed(path, trainer_killed(path, case, *end), s3, tally, case.point)
        for path, case, end in zip(paths, cases, ended, strict=True)
    ]
    time.sleep(EXPIRED)
    for recover in recoveries:
        recover()
    return tally


def test_the_trainer_killed_at_each_writer_point_resumes_from_its_last_commit(
    tmp_path: Path, s3_client: Any
) -> None:
    check_trainer_cases(tmp_path, TRAINER, s3_client).report("2-rank trainer")


@pytest.mark.faults
@pytest.mark.skipif(
    not os.environ.get(SEEDS_VARIABLE),
    reason="make faults only (its points are armed in the promoter by make test)",
)
def test_the_trainer_killed_in_its_marker_publish_resumes_from_its_last_commit(
    tmp_path: Path, s3_client: Any
) -> None:
    check_trainer_cases(tmp_path, TRAINER_MARKER, s3_client).report("2-rank trainer, marker")


# -- the promoter --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Promoted:
    """Two checkpoints committed in memory, for a promoter to copy into ``target``."""

    path: Path
    config: Config
    target: str
    state: Callable[[int], dict[str, Any]]


def promoter_setup(root: Path, target: str, s3: tuple[str, str] | None, *, big: bool) -> Promoted:
    path = write_config(root, target, s3)
    config = load(path)
    state = big_state if big else small_state
    for step in (1, 2):
        save(config, step, state(step))
    return Promoted(path, config, target, state)


def promoted_copies_restore(job: Promoted) -> list[str]:
    """Every copy committed in the target restores bit-exact from there; their ids."""
    alone = only_tier(job.config, job.target)
    tier = alone.make_tiers(node=0)[0]
    ids = [f"step_{s}" for s in (1, 2) if tier.exists(marker_path(f"step_{s}"))]
    for checkpoint_id in ids:
        assert_restores(alone, checkpoint_id, job.state(int(checkpoint_id[-1])))
        assert read_manifest(tier, checkpoint_id, trust=MarkerTrust()).provenance, "not a promoted marker"
    assert latest_committed(alone, collective=False) == (ids[-1] if ids else None)
    return ids


def promoter_survived(job: Promoted) -> list[str]:
    """Right after the kill: nothing partial is listed or loadable; what the target commits
    restores bit-exact from there, and the newest checkpoint still restores."""
    assert_audit_clean(job.config)
    assert latest_committed(job.config, collective=False) == "step_2"
    return promoted_copies_restore(job)


def promoter_restarted(job: Promoted, s3: Any, tally: Tally, point: str) -> Recovery:
    """Restart the promoter at once, while the dead one's activity record still looks live: one
    pass promotes both checkpoints. Returns the rest of the recovery: gc once the record expired,
    then the oracle (both copies restore bit-exact from the target)."""
    report = Promoter(job.config, node=0).run_once()
    assert not report.failed, report.failed
    target = only_tier(job.config, job.target).make_tiers(node=0)[0]
    assert all(target.exists(marker_path(f"step_{s}")) for s in (1, 2)), "not redone"

    def cleaned() -> None:
        gc(job.path)
        assert promoted_copies_restore(job) == ["step_1", "step_2"]
        recovered(job.config, s3, tally, point)

    return cleaned


def promoter_one_pass(job: Promoted, s3: Any, tally: Tally, point: str) -> None:
    """Restart the promoter once the dead one's record expired: its one pass promotes both
    checkpoints and leaves nothing behind (its own records included: a refresh landing after a
    release once left a record that kept the dead promoter's upload, see
    ``tests/records/test_activity_release.py``)."""
    report = Promoter(job.config, node=0).run_once()
    assert not report.failed, report.failed
    assert promoted_copies_restore(job) == ["step_1", "step_2"]
    recovered(job.config, s3, tally, point)


def test_the_promoter_killed_at_each_point_is_redone_without_leftovers(
    tmp_path: Path, s3_endpoint: str, s3_client: Any
) -> None:
    killed: list[Recovery] = []
    tally = Tally()
    for index, case in enumerate(PROMOTER):
        bucket = f"ts-kill-{uuid.uuid4().hex[:12]}"
        s3_client.create_bucket(Bucket=bucket)
        job = promoter_setup(tmp_path / f"p{index}", case.target, (s3_endpoint, bucket), big=case.big)
        assert_killed_at(*run_cli(job.path, "promote", case.spec), case, by_mp=False)
        promoter_survived(job)
        uploads = open_upload_count(job.config, s3_client)[0]
        assert uploads == (1 if case.upload_open else 0), f"{case.spec}: {uploads} uploads open"
        killed.append(promoter_restarted(job, s3_client, tally, case.point))
    time.sleep(EXPIRED)
    for recover in killed:
        recover()
    tally.report("promoter")


# -- gc ------------------------------------------------------------------------------------------


LEFTOVER_IDS = ("step_8", "step_9")


def gc_setup(root: Path, steps: int) -> tuple[Path, Config]:
    """``steps`` checkpoints committed in memory and promoted to the shared tier; two uncommitted
    generations left in memory by saves that died (their data files, no marker, no record). Returns
    the config with which gc keeps only the newest in memory."""
    config = load(write_config(root, "shared", None))
    for step in range(1, steps + 1):
        save(config, step, small_state(step))
    assert not Promoter(config, node=0).run_once().failed
    memory = config.make_tiers(node=0)[0]
    for checkpoint_id in LEFTOVER_IDS:
        with memory.open_write(f"{checkpoint_id}/g{uuid.uuid4().hex[:12]}/r00000-0.distcp") as f:
            f.write(os.urandom(4096))
    return write_config(root, "shared", None, memory={"keep": 1}), config


def gc_survived(path: Path, steps: int) -> None:
    """Right after the kill: nothing committed is damaged, the newest restores, and every
    checkpoint restores from the shared tier."""
    config = load(path)
    assert_audit_clean(config)
    assert latest_committed(config, collective=False) == f"step_{steps}"
    assert_restores(config, f"step_{steps}", small_state(steps))
    shared = only_tier(config, "shared")
    for step in range(1, steps + 1):
        assert_restores(shared, f"step_{step}", small_state(step))


def gc_recovered(path: Path, steps: int, s3: Any, tally: Tally, point: str) -> None:
    gc(path)
    config = load(path)
    memory = config.make_tiers(node=0)[0]
    held = [s for s in range(1, steps + 1) if memory.exists(marker_path(f"step_{s}"))]
    assert held == [steps], f"{point}: memory keeps {held}"
    gc_survived(path, steps)
    recovered(config, s3, tally, point)


def test_gc_killed_at_each_point_finishes_on_the_next_run(tmp_path: Path, s3_client: Any) -> None:
    steps = 3
    prepared = [(case, gc_setup(tmp_path / f"g{i}", steps)[0]) for i, case in enumerate(GC)]
    time.sleep(STALE)  # the leftovers are stale: the killed gc reaches its removals
    for case, path in prepared:
        assert_killed_at(*run_cli(path, "gc", case.spec), case, by_mp=False)
        gc_survived(path, steps)
    time.sleep(EXPIRED)
    tally = Tally()
    for case, path in prepared:
        gc_recovered(path, steps, s3_client, tally, case.point)
    tally.report("gc")


def test_every_kill_point_is_armed_by_a_case_of_make_test() -> None:
    armed = {case.point for case in TRAINER + PROMOTER + GC}
    assert armed == set(KILL_POINTS)


# -- random kills --------------------------------------------------------------------------------


Ready = Callable[["subprocess.Popen[str]"], bool]


def kill_at_random(argv: list[str], rng: random.Random, window: float, ready: Ready) -> tuple[float, bool]:
    """Start ``argv`` (its own process group); once ``ready(process)`` holds (polled: the actor
    has begun the work under test), SIGKILL the group after a random delay in ``[0, window)``.
    Returns the delay and whether the kill landed (False: the process had ended first)."""
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    delay = rng.uniform(0.0, window)
    try:
        deadline = time.monotonic() + 120
        while not ready(process) and process.poll() is None:
            assert time.monotonic() < deadline, f"{argv}: never began its work"
            time.sleep(0.005)
        time.sleep(delay)
    finally:
        landed = process.poll() is None
        with contextlib.suppress(ProcessLookupError):  # the group may have ended on its own
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    return delay, landed


def said(line: str) -> Ready:
    """Ready once the process printed ``line`` (polled: a hung process fails by the deadline)."""

    def printed(process: subprocess.Popen[str]) -> bool:
        assert process.stdout is not None
        if not select.select([process.stdout], [], [], 0.05)[0]:
            return False
        return line in process.stdout.readline()

    return printed


def random_trainer(root: Path, rng: random.Random, s3: Any, tally: Tally) -> Recovery:
    """The 2-rank trainer saving steps 1-6 (async_save), killed at a random moment after its
    first commit: what it committed last restores; the recovery resumes from there."""
    path = write_config(root, "shared", None)
    argv = [sys.executable, str(CHILD), str(path), "1", "6", "async", str(root / "store")]
    delay, landed = kill_at_random(argv, rng, 0.5, said("committed step_1"))
    config = load(path)
    latest = latest_committed(config, collective=False)
    print(f"  trainer killed {delay:.2f}s after its first commit (landed: {landed}): {latest}")
    assert latest is not None
    assert_restores(config, latest, job_state(int(latest.split("_")[1])))
    assert_audit_clean(config)
    return trainer_resumed(path, config, s3, tally, "random: trainer")


def random_promoter(
    root: Path, rng: random.Random, target: str, *, s3: tuple[str, str], client: Any, tally: Tally
) -> Recovery:
    """``promote --once`` of two 12 MiB checkpoints killed at a random moment once it has begun
    writing into the target (S3: an upload is open; POSIX: a file of ``step_1`` is there)."""
    job = promoter_setup(root, target, s3, big=True)
    bucket = s3[1]
    shared = job.path.parent / "shared" / "step_1"

    def begun(_process: object) -> bool:
        if target == "s3":
            return bool(client.list_multipart_uploads(Bucket=bucket).get("Uploads"))
        return shared.is_dir() and any(shared.rglob("*"))

    delay, landed = kill_at_random(cli_argv(job.path, "promote"), rng, 0.4, begun)
    ids = promoter_survived(job)
    uploads = open_upload_count(job.config, client)[0]
    print(
        f"  promoter to {target} killed at {delay:.2f}s (landed: {landed}): committed {ids},"
        f" {uploads} uploads open"
    )
    return lambda: promoter_one_pass(job, client, tally, f"random: promoter to {target}")


def random_gc(root: Path, rng: random.Random, s3: Any, tally: Tally) -> Recovery:
    """``gc`` deleting five old copies and two leftovers, killed at a random moment."""
    steps = 6
    path, _config = gc_setup(root, steps)
    time.sleep(STALE)
    started = time.monotonic()
    delay, landed = kill_at_random(
        cli_argv(path, "gc"), rng, 1.2, lambda _p: time.monotonic() - started > 0.2
    )
    print(f"  gc killed at {delay:.2f}s (landed: {landed})")
    gc_survived(path, steps)
    return lambda: gc_recovered(path, steps, s3, tally, "random: gc")


@pytest.mark.faults
@pytest.mark.parametrize("seed", fault_seeds(1))
def test_sigkill_at_random_times_never_damages_a_commit_nor_leaks(
    tmp_path: Path, seed: int, s3_endpoint: str, s3_client: Any
) -> None:
    """SIGKILL at a seeded random time: the 2-rank trainer, the promoter mid-multipart-upload,
    the promoter between data and marker (POSIX target), and gc."""
    print(f"\nseed {seed} (TIERSTORE_FAULT_SEED={seed} reruns it)")
    rng = random.Random(seed)  # noqa: S311 - a reproducible sweep, not cryptography
    tally = Tally()
    bucket = f"ts-kill-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    s3: dict[str, Any] = {"s3": (s3_endpoint, bucket), "client": s3_client, "tally": tally}
    actors: list[Callable[[], Recovery]] = [
        lambda: random_trainer(tmp_path / "trainer", rng, s3_client, tally),
        lambda: random_promoter(tmp_path / "s3", rng, "s3", **s3),
        lambda: random_promoter(tmp_path / "shared", rng, "shared", **s3),
        lambda: random_gc(tmp_path / "gc", rng, s3_client, tally),
    ]
    recoveries = [actor() for actor in actors]
    time.sleep(EXPIRED)
    for recover in recoveries:
        recover()
    print(
        f"seed {seed}: {tally.cases} of {len(actors)} random kills survived; orphaned uploads"
        f" {tally.uploads}; bytes leaked {tally.leaked}"
    )
