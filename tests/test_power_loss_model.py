"""The power-cut model of tests/power_loss.py, on plain ``os`` calls whose crash states are known."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.power_loss import OsRecorder, Trace, Tree, materialise, tmpfs_dir, tree_digest
from tierstore.tiers.durable import fsync_dir


@pytest.fixture
def shm_root() -> Iterator[Path]:
    with tmpfs_dir("tierstore-model-") as directory:
        yield directory


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _last(trace: Trace, call: str) -> int:
    return max(op.index for op in trace.ops if op.call == call)


def test_a_renamed_file_never_fsynced_is_empty_after_the_cut(shm_root: Path) -> None:
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        _write(shm_root / ".a.tmp", b"payload", sync=False)
        os.rename(shm_root / ".a.tmp", shm_root / "a")
        fsync_dir(shm_root)
    assert trace.crash_state(_last(trace, "rename")).tree == {}  # the name is not durable yet
    assert trace.crash_state(len(trace.ops)).tree == {"a": b""}  # durable name, lost data


def test_a_name_not_fsynced_in_its_directory_is_dropped_unless_flushed(shm_root: Path) -> None:
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        _write(shm_root / ".a.tmp", b"payload", sync=True)
        os.rename(shm_root / ".a.tmp", shm_root / "a")
    end = len(trace.ops)
    assert trace.crash_state(end).tree == {}
    states = trace.crash_states(end, flushed=True, prefixes=False)
    assert [s.tree for s in states] == [{}, {"a": b"payload"}]


def test_an_unlink_not_fsynced_brings_the_old_file_back(shm_root: Path) -> None:
    _write(shm_root / "kept", b"old bytes", sync=True)  # before recording: durable
    (shm_root / "sub").mkdir()
    (shm_root / "sub" / "x").write_bytes(b"x")
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        os.unlink(shm_root / "kept")
        shutil.rmtree(shm_root / "sub")  # fd-relative unlink and rmdir: recorded too
    assert trace.crash_state(len(trace.ops)).tree == {"kept": b"old bytes", "sub": {"x": b"x"}}
    assert {op.path for op in trace.ops} >= {"kept", "sub/x", "sub"}
    with recorder.active():
        fsync_dir(shm_root)
    assert trace.crash_state(len(trace.ops)).tree == {}


def test_writes_after_the_last_fsync_give_one_prefix_state_each(shm_root: Path) -> None:
    _write(shm_root / "log", b"base", sync=True)
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        fd = os.open(shm_root / "log", os.O_WRONLY)
        try:
            os.lseek(fd, 0, os.SEEK_END)
            for chunk in (b"1", b"22", b"333"):
                os.write(fd, chunk)
        finally:
            os.close(fd)
    end = len(trace.ops)
    assert trace.crash_state(end).tree == {"log": b"base"}
    states = trace.crash_states(end, flushed=False, prefixes=True)
    assert [s.tree["log"] for s in states] == [b"base", b"base1", b"base122", b"base122333"]


def test_calls_outside_the_root_are_not_recorded(shm_root: Path) -> None:
    inside = shm_root / "inside"
    inside.mkdir()
    recorder = OsRecorder(inside)
    with recorder.active() as trace:
        _write(shm_root / "outside", b"x", sync=True)
        fsync_dir(shm_root)
    assert trace.ops == []


def test_equal_trees_have_equal_digests_and_materialise_as_given(shm_root: Path) -> None:
    tree: Tree = {"a": b"1", "d": {"b": b"22", "e": {}}}
    same: Tree = {"d": {"e": {}, "b": b"22"}, "a": b"1"}
    other: Tree = {"a": b"1", "d": {"b": b"2", "e": {}}}
    materialise(tree, shm_root / "out")
    assert (shm_root / "out" / "d" / "b").read_bytes() == b"22"
    assert (shm_root / "out" / "d" / "e").is_dir()
    assert tree_digest(tree) == tree_digest(same)
    assert tree_digest(tree) != tree_digest(other)


def test_the_recorder_refuses_a_root_that_is_not_tmpfs(disk_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="tmpfs"):
        OsRecorder(disk_dir)


def test_a_file_written_in_a_flushed_directory_shows_each_prefix_of_its_writes(shm_root: Path) -> None:
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        fd = os.open(shm_root / ".part.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"ab")
            os.write(fd, b"cd")
        finally:
            os.close(fd)
    states = trace.crash_states(len(trace.ops), flushed=True, prefixes=True)
    assert [s.tree for s in states] == [{}, {".part.tmp": b""}, {".part.tmp": b"ab"}, {".part.tmp": b"abcd"}]


def test_a_call_the_model_does_not_know_fails_the_recording(shm_root: Path) -> None:
    recorder = OsRecorder(shm_root)
    fd = os.open(shm_root / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with recorder.active(), pytest.raises(AssertionError, match=r"os\.writev"):
            os.writev(fd, [b"x"])
    finally:
        os.close(fd)
    assert not (shm_root / "f").stat().st_size  # refused, not made


def test_appended_writes_are_placed_at_the_end(shm_root: Path) -> None:
    _write(shm_root / "log", b"base", sync=True)
    recorder = OsRecorder(shm_root)
    with recorder.active() as trace:
        fd = os.open(shm_root / "log", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"+tail")
        finally:
            os.close(fd)
    states = trace.crash_states(len(trace.ops), flushed=False, prefixes=True)
    assert [s.tree["log"] for s in states] == [b"base", b"base+tail"]
