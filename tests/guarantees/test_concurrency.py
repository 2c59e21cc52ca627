"""Saves, overwrites, cleanup and restores at the same time on the same ids: nothing committed is
lost, and no marker is ever published over missing data.

Pauses are real: a save is held inside its commit gate (a public hook that runs after the rank's
files are durable and before the marker), on another thread, while the other actor runs to the end.
After every scenario the audit of ``tierstore verify --all`` finds nothing wrong.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.cli.audit import audit_all
from tierstore.config import Config
from tierstore.dcp.save.gate import GateView
from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file, generation_dir
from tierstore.promote.retention import delete_copy
from tierstore.promote.sidecar import Promoter
from tierstore.records.activity import held
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


def state_of(value: float) -> dict[str, Any]:
    return {"w": torch.full((4096,), value), "step": int(value)}


class Pause:
    """A commit gate that holds its save until released: the save's files are written, no marker."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, _view: GateView) -> str | None:
        self.reached.set()
        assert self.go.wait(60), "the test never released the paused save"
        return None


def paused_save(
    pool: ThreadPoolExecutor, config: Config, checkpoint_id: str, value: float, **writer: Any
) -> tuple[Pause, Future[None]]:
    pause = Pause()
    save = TieredWriter(config, commit_gate=pause, **writer)
    future = pool.submit(dcp.save, state_of(value), storage_writer=save, checkpoint_id=checkpoint_id)
    assert pause.reached.wait(60), "the save never reached its gate"
    return pause, future  # type: ignore[return-value]


def loaded(config: Config, checkpoint_id: str) -> float:
    target = state_of(-1.0)
    dcp.load(target, storage_reader=TieredReader(config, verify=True), checkpoint_id=checkpoint_id)
    assert torch.equal(target["w"], torch.full((4096,), float(target["step"])))
    return float(target["step"])


def assert_audit_clean(config: Config) -> None:
    bad = [a for a in audit_all(config, [0]) if not a.ok]
    assert bad == [], "a marker stands over missing or wrong data"


def test_two_overwrites_of_one_id_never_commit_over_deleted_files(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="latest")
    with ThreadPoolExecutor(1) as pool:
        # A zombie job's save of "latest" is planned first and is still writing ...
        zombie, zombie_done = paused_save(pool, config, "latest", 2.0, overwrite=True)
        # ... while the restarted job saves "latest" again and commits first.
        dcp.save(state_of(3.0), storage_writer=TieredWriter(config, overwrite=True), checkpoint_id="latest")
        assert loaded(config, "latest") == 3.0
        zombie.go.set()
        zombie_done.result()
    assert loaded(config, "latest") == 2.0, "the last commit wins, whole"
    assert_audit_clean(config)


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_cleanup_never_removes_an_in_flight_save(kind: str, make_config: Callable[..., Config]) -> None:
    config = make_config(kind, promote={"stale_after": 0})  # cleanup takes anything uncommitted
    with ThreadPoolExecutor(1) as pool:
        pause, done = paused_save(pool, config, "step_000007", 7.0)
        report = Promoter(config).run_once()  # retention and cleanup, while the save waits
        assert report.cleaned == [], "the in-flight generation was taken for a leftover"
        pause.go.set()
        done.result()
    assert loaded(config, "step_000007") == 7.0
    assert_audit_clean(config)


def test_a_file_removed_before_the_marker_fails_the_save_instead(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    (local,) = config.make_tiers(node=0)
    with ThreadPoolExecutor(1) as pool:
        pause, done = paused_save(pool, config, "step_000001", 1.0)
        (generation,) = [n for n in local.list_dir("step_000001") if n.startswith("g")]
        victim = next(f.path for f in local.find(generation_dir("step_000001", generation)))
        local.delete(victim)  # an operator, or a cleanup that ignores the rules
        pause.go.set()
        with pytest.raises(BaseException, match="vanished before the marker") as caught:
            done.result()
    assert "IntegrityError" in str(caught.value) or isinstance(caught.value, IntegrityError)
    assert not local.exists(checkpoint_file("step_000001", "commit.json"))
    assert_audit_clean(config)


def test_a_restore_in_progress_keeps_the_generation_it_reads(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", promote={"stale_after": 0})
    (memory,) = config.make_tiers(node=0)
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="latest")
    old = read_manifest(memory, "latest", trust=MarkerTrust())
    with held(memory, "read", "latest", None):  # what TieredReader holds while it reads
        dcp.save(state_of(2.0), storage_writer=TieredWriter(config, overwrite=True), checkpoint_id="latest")
        Promoter(config).run_once()
        for entry in old.files:  # the reader may still be reading any of them
            assert memory.exists(checkpoint_file("latest", entry.path))
    report = Promoter(config).run_once()  # the reader is gone: the old generation is cleaned up
    assert [c.path for c in report.cleaned if c.kind == "tree"] == [generation_dir("latest", old.generation)]
    assert loaded(config, "latest") == 2.0
    assert_audit_clean(config)


def cleanup_loop(config: Config, stop: threading.Event, cleaned: list[str]) -> None:
    while not stop.is_set():
        cleaned += [c.path for c in Promoter(config).run_once().cleaned]


@pytest.mark.slow  # writes 800 MiB while cleanup loops: make test runs it, make quick does not
@pytest.mark.parametrize(("kind", "mib"), [("local", 512), ("s3", 300)])
def test_cleanup_looping_through_a_save_never_touches_its_writes(
    kind: str, mib: int, make_config: Callable[..., Config]
) -> None:
    """Temp files and multipart uploads of a save being written look idle to nothing but time."""
    config = make_config(kind, promote={"stale_after": 0})
    stop, cleaned = threading.Event(), []  # type: ignore[var-annotated]
    loop = threading.Thread(target=cleanup_loop, args=(config, stop, cleaned))
    loop.start()
    try:
        state = {"w": torch.ones(mib * 2**20 // 4), "step": 1}
        dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    finally:
        stop.set()
        loop.join()
    assert cleaned == []
    assert_audit_clean(config)


def test_retention_leaves_the_data_of_a_copy_a_restore_has_chosen(make_config: Callable[..., Config]) -> None:
    config = make_config("local", tiers={"local": {"keep": 1}}, promote={"stale_after": 0})
    (local,) = config.make_tiers(node=0)
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    chosen = read_manifest(local, "step_000001", trust=MarkerTrust())
    dcp.save(state_of(2.0), storage_writer=TieredWriter(config), checkpoint_id="step_000002")
    promoter = Promoter(config)
    planned = promoter.apply_retention(promoter.catalog(), dry_run=True)  # retention decides: keep 1 ...
    assert [d.checkpoint_id for d in planned] == ["step_000001"]
    with held(local, "read", "step_000001", chosen.generation):  # ... then a restore chooses it
        for deletion in planned:  # retention's routine
            delete_copy(local, deletion.checkpoint_id, deletion.generation, trust=MarkerTrust())
        assert not local.exists(checkpoint_file("step_000001", "commit.json"))  # the copy is gone ...
        for entry in chosen.files:  # ... but not the data the reader is reading
            assert local.exists(checkpoint_file("step_000001", entry.path)), entry.path
    assert [c.path for c in promoter.run_once().cleaned if c.kind == "tree"] == [
        generation_dir("step_000001", chosen.generation)
    ], "once the reader is done, cleanup removes it"


def test_two_saves_of_one_id_into_two_tiers_never_both_commit(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "s3")
    memory, _s3 = config.make_tiers(node=0)
    with ThreadPoolExecutor(1) as pool:
        first, first_done = paused_save(pool, config, "step_000005", 5.0)
        dcp.save(state_of(6.0), storage_writer=TieredWriter(config, tier="s3"), checkpoint_id="step_000005")
        first.go.set()
        with pytest.raises(BaseException, match="step_000005"):
            first_done.result()
    assert not memory.exists(checkpoint_file("step_000005", "commit.json"))
    assert loaded(config, "step_000005") == 6.0
    assert_audit_clean(config)


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_the_last_overwrite_to_commit_reaches_every_tier(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "s3")
    memory, s3 = config.make_tiers(node=0)
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="latest")
    Promoter(config).run_once()
    with ThreadPoolExecutor(1) as pool:
        zombie, zombie_done = paused_save(pool, config, "latest", 2.0, overwrite=True)
        dcp.save(state_of(3.0), storage_writer=TieredWriter(config, overwrite=True), checkpoint_id="latest")
        Promoter(config).run_once()  # 3.0 reaches S3
        zombie.go.set()
        zombie_done.result()  # 2.0 commits last
    Promoter(config).run_once()
    generations = {t.name: read_manifest(t, "latest", trust=MarkerTrust()).generation for t in (memory, s3)}
    assert generations["memory"] == generations["s3"], "every tier holds the last commit"
    memory.delete_tree("latest")  # the fast copy is lost: S3 serves the same content
    assert loaded(config, "latest") == 2.0
    assert_audit_clean(config)


def test_a_failed_overwrite_does_not_make_its_id_the_newest(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", promote={"stale_after": 0})
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="x")
    dcp.save(state_of(2.0), storage_writer=TieredWriter(config), checkpoint_id="y")
    vetoed = TieredWriter(config, overwrite=True, commit_gate=lambda _view: "loss spike")
    with pytest.raises(BaseException, match="loss spike"):
        dcp.save(state_of(3.0), storage_writer=vetoed, checkpoint_id="x")
    del vetoed
    assert latest_committed(config) == "y", "the vetoed overwrite claimed a number, nothing more"
    Promoter(config).run_once()
    assert latest_committed(config) == "y"


def test_commit_order_is_the_order_commits_happened(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    with ThreadPoolExecutor(1) as pool:
        late, late_done = paused_save(pool, config, "a", 1.0)  # planned first ...
        dcp.save(state_of(2.0), storage_writer=TieredWriter(config), checkpoint_id="b")
        late.go.set()
        late_done.result()  # ... committed last
    assert latest_committed(config) == "a"


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_a_restore_never_serves_an_older_generation_from_a_faster_tier(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", "s3")
    dcp.save(state_of(1.0), storage_writer=TieredWriter(config), checkpoint_id="x")
    Promoter(config).run_once()
    dcp.save(state_of(2.0), storage_writer=TieredWriter(config, tier="s3", overwrite=True), checkpoint_id="x")
    assert loaded(config, "x") == 2.0, "memory still holds the overwritten generation"
