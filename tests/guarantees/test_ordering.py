"""Durability order, observed: fsync before rename, data before metadata, metadata before marker,
new marker before old data is deleted. Each test would fail if the code did things in another order."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from tests.training import Trainer
from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.ids import CHANGES_PATH, HEAD_PATH, marker_path
from tierstore.records.log import read_log
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier
from tierstore.tiers.posix import PosixTier
from tierstore.tiers.s3.client import S3Client


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record fsync (by path), rename, link and mkdir, in order."""
    log: list[tuple[str, str]] = []
    real_fsync, real_rename, real_link = os.fsync, os.rename, os.link

    def fsync(fd: int) -> None:
        log.append(("fsync", _fd_path(fd)))
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        log.append(("rename", f"{src} -> {dst}"))
        real_rename(src, dst)

    def link(src: Any, dst: Any) -> None:
        log.append(("link", f"{src} -> {dst}"))
        real_link(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "link", link)
    return log


def test_file_is_fsynced_before_rename_and_directory_after(
    tmp_path: Path, syscalls: list[tuple[str, str]]
) -> None:
    tier = PosixTier("t", "local", str(tmp_path), node_local=True)
    tier.write_bytes("ckpt/data.bin", b"payload")
    kinds = [kind for kind, _ in syscalls]
    rename_at = kinds.index("rename")
    temp, target = syscalls[rename_at][1].split(" -> ")
    assert ("fsync", temp) in syscalls[:rename_at], "file must be fsynced before it is renamed"
    assert ("fsync", str(tmp_path / "ckpt")) in syscalls[rename_at + 1 :], "dir fsync after rename"
    assert target == str(tmp_path / "ckpt" / "data.bin")


def test_new_directories_are_made_durable_in_their_parent(
    tmp_path: Path, syscalls: list[tuple[str, str]]
) -> None:
    tier = PosixTier("t", "local", str(tmp_path), node_local=True)
    tier.write_bytes("a/b/file", b"x")
    synced = [path for kind, path in syscalls if kind == "fsync"]
    assert synced.index(str(tmp_path)) < synced.index(str(tmp_path / "a"))


def test_create_only_marker_links_after_fsync(tmp_path: Path, syscalls: list[tuple[str, str]]) -> None:
    tier = PosixTier("t", "local", str(tmp_path), node_local=True)
    tier.publish("ckpt/commit.json", b"{}", create_only=True)
    kinds = [kind for kind, _ in syscalls]
    link_at = kinds.index("link")
    temp = syscalls[link_at][1].split(" -> ")[0]
    assert ("fsync", temp) in syscalls[:link_at]
    assert ("fsync", str(tmp_path / "ckpt")) in syscalls[link_at + 1 :]


@pytest.fixture
def tier_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record when each file becomes visible in a POSIX tier, and each deletion, in order."""
    events: list[tuple[str, str]] = []
    real_open_write, real_publish = PosixTier.open_write, PosixTier.publish
    real_delete_tree = PosixTier.delete_tree

    @contextmanager
    def open_write(self: PosixTier, path: str) -> Iterator[Any]:
        with real_open_write(self, path) as stream:
            yield stream
        events.append(("visible", path))

    def publish(self: PosixTier, path: str, data: bytes, *, create_only: bool) -> None:
        real_publish(self, path, data, create_only=create_only)
        events.append(("marker", path))

    def delete_tree(self: PosixTier, path: str) -> None:
        events.append(("delete", path))
        real_delete_tree(self, path)

    monkeypatch.setattr(PosixTier, "open_write", open_write)
    monkeypatch.setattr(PosixTier, "publish", publish)
    monkeypatch.setattr(PosixTier, "delete_tree", delete_tree)
    return events


def _save(config: Config, checkpoint_id: str, **writer: Any) -> None:
    trainer = Trainer(seed=0)
    trainer.train(1)
    dcp.save(trainer.state(), storage_writer=TieredWriter(config, **writer), checkpoint_id=checkpoint_id)


def test_data_then_metadata_then_marker(
    make_config: Callable[..., Config], tier_events: list[tuple[str, str]]
) -> None:
    config = make_config("local")
    _save(config, "step_000001")
    assert tier_events[-1] == ("marker", CHANGES_PATH), "the change stamp follows the marker"
    tier_events[:] = [e for e in tier_events if e[1] != CHANGES_PATH]  # records/changes.py
    order = [path.rsplit("/", 1)[-1] for _, path in tier_events]
    assert order[0].startswith("write~step_000001~"), "the save announces itself before any data"
    assert order[1] == "000000000001~void" and tier_events[1][0] == "marker", "takes its number"
    assert "~step_000001~g" in order[2] and tier_events[2][0] == "marker", "then names it"
    assert tier_events[3] == ("marker", HEAD_PATH), "then raises the head record (records/log.py)"
    assert order[-1] == "commit.json" and tier_events[-1][0] == "marker"
    assert order[-2] == ".metadata"
    assert set(order[4:-2]) == {"r00000-0.distcp", "r00000-1.distcp"}


def test_failed_metadata_write_leaves_no_marker(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("local")
    real = PosixTier.write_bytes

    def failing(self: PosixTier, path: str, data: Any) -> None:
        if path.endswith(".metadata"):
            raise OSError(28, "No space left on device")
        real(self, path, data)

    monkeypatch.setattr(PosixTier, "write_bytes", failing)
    with pytest.raises(BaseException, match="No space left"):
        _save(config, "step_000001")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    assert not tier.exists(marker_path("step_000001"))


def test_overwrite_publishes_new_marker_before_deleting_old_data(
    make_config: Callable[..., Config], tier_events: list[tuple[str, str]]
) -> None:
    config = make_config("local")
    _save(config, "step_000001")
    tier_events.clear()
    _save(config, "step_000001", overwrite=True)
    kinds = [kind for kind, _ in tier_events]
    assert "delete" in kinds
    assert kinds.index("marker") < kinds.index("delete")


def test_overwrite_forgets_the_replaced_generations_log_entry_after_its_new_marker(
    make_config: Callable[..., Config], tier_events: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log names each committed generation once: the replaced one's entry goes, but only once
    the new marker stands (before it, the old generation is still the committed one)."""
    config = make_config("local")
    _save(config, "step_000001")
    tier = make_tier(config.tiers[0], namespace=config.namespace, node=0)
    (old,) = [e for e in read_log(tier) if e.checkpoint_id == "step_000001"]
    real_delete = PosixTier.delete

    def delete(self: PosixTier, path: str) -> None:
        tier_events.append(("delete file", path))
        real_delete(self, path)

    monkeypatch.setattr(PosixTier, "delete", delete)
    tier_events.clear()
    _save(config, "step_000001", overwrite=True)
    (new,) = [e for e in read_log(tier) if e.checkpoint_id == "step_000001"]
    assert new.generation != old.generation
    assert new.generation == read_manifest(tier, "step_000001", trust=MarkerTrust()).generation
    assert tier_events.index(("marker", marker_path("step_000001"))) < tier_events.index(
        ("delete file", old.path)
    )


def test_s3_marker_is_put_after_every_data_object(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("s3")
    calls: list[tuple[str, str]] = []
    real_call = S3Client.call

    def call(self: S3Client, method: str, what: str, **kwargs: Any) -> Any:
        result = real_call(self, method, what, **kwargs)
        calls.append((method, str(kwargs.get("Key", ""))))
        return result

    monkeypatch.setattr(S3Client, "call", call)
    _save(config, "step_000001")
    completed = [key for method, key in calls if method in ("put_object", "complete_multipart_upload")]
    assert completed[-1].endswith(CHANGES_PATH), "the change stamp follows the marker"
    completed = [key for key in completed if not key.endswith(CHANGES_PATH)]
    assert completed[-1].endswith("step_000001/commit.json")
    assert any(key.endswith(".metadata") for key in completed[:-1])
    assert any(key.endswith(".distcp") for key in completed[:-1])


def test_cleanup_removes_part_records_before_data_and_keeps_a_generation_committed_meanwhile(
    make_config: Callable[..., Config], tier_events: list[tuple[str, str]]
) -> None:
    from tierstore.ids import generation_dir, node_part_path, parts_dir
    from tierstore.promote.cleanup import remove_generation

    config = make_config("shared")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    gen = "g0000000000100000000"
    tier.write_bytes(f"ckpt/{gen}/r00001-0.distcp", b"node 1's part")
    tier.write_bytes(node_part_path("ckpt", gen, 1), b"{}")
    tier_events.clear()
    assert remove_generation(tier, "ckpt", gen, trust=MarkerTrust())
    deletions = [path for kind, path in tier_events if kind == "delete"]
    assert deletions == [parts_dir("ckpt", gen), generation_dir("ckpt", gen)], (
        "a promoter needs the part records to publish: they go first"
    )

    _save(config, "step_000001")  # a committed generation is never removed by cleanup
    committed = read_manifest(tier, "step_000001", trust=MarkerTrust()).generation
    assert not remove_generation(tier, "step_000001", committed, trust=MarkerTrust())
    assert read_manifest(tier, "step_000001", trust=MarkerTrust()).generation == committed
    assert tier.exists(f"step_000001/{committed}/.metadata")
