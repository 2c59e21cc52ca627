"""One contract, every tier type: what the Tier seam promises, checked on memory, local, shared, s3,
and on ``dict``, a tier type the tests register without touching tierstore (tests/tiers/dict_tier.py).
Verbs of local files are checked through ``tier.local``; a tier without them skips those cases explicitly."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.forked import in_forked_child
from tests.process_files import mapped_inodes, open_inodes
from tierstore.tiers import LocalFace, Tier, make_tier

KINDS = ["memory", "local", "shared", "s3", "dict"]
LOCAL_VERBS = ("map_file", "own_directory", "owner_alive", "directory_mtime", "open_landing", "adopt")
LOCAL_VERBS += ("recycle", "remove_if_empty", "space")


@pytest.fixture(params=KINDS)
def tier(request: pytest.FixtureRequest, make_config: Callable[..., Any]) -> Tier:
    config = make_config(request.param, namespace="ns")
    return make_tier(config.tiers[0], namespace=config.namespace, node=0)


def local_face(tier: Tier) -> LocalFace | None:
    """``tier.local``; a tier without one offers none of its verbs (callers ask for the face)."""
    if tier.local is None:
        assert [v for v in LOCAL_VERBS if hasattr(tier, v)] == [], f"{tier.type}: verbs of local files"
    return tier.local


def test_round_trip_and_replace(tier: Tier) -> None:
    tier.write_bytes("a/b/file.bin", b"first version")
    assert tier.read_bytes("a/b/file.bin") == b"first version"
    tier.write_bytes("a/b/file.bin", b"second")
    assert tier.read_bytes("a/b/file.bin") == b"second"
    assert tier.stat("a/b/file.bin").size == 6


def test_streamed_write_larger_than_a_part(tier: Tier) -> None:
    payload = os.urandom(12 * 2**20 + 123)  # more than two 5 MiB parts on S3: multipart
    with tier.open_write("big/object") as stream:
        for start in range(0, len(payload), 3 * 2**20):
            stream.write(payload[start : start + 3 * 2**20])
    assert tier.stat("big/object").size == len(payload)
    assert tier.read_bytes("big/object") == payload


def test_byte_ranges(tier: Tier) -> None:
    payload = bytes(range(256)) * 64
    tier.write_bytes("r/data", payload)
    assert tier.read_range("r/data", 100, 50) == payload[100:150]
    assert tier.read_range("r/data", len(payload) - 10) == payload[-10:]
    out = bytearray(300)
    tier.read_into("r/data", 1000, memoryview(out))
    assert bytes(out) == payload[1000:1300]
    assert b"".join(tier.iter_chunks("r/data", chunk_size=1000)) == payload


def test_a_scattered_read_fills_its_buffers_in_order_from_one_range(tier: Tier) -> None:
    payload = os.urandom(3 * 2**20 + 5)
    tier.write_bytes("r/scattered", payload)
    outs = [bytearray(7), bytearray(0), bytearray(2**20), bytearray(2**20 + 1)]
    tier.read_into("r/scattered", 100, [memoryview(o) for o in outs])
    assert b"".join(outs) == payload[100 : 100 + 2 * 2**20 + 8]
    with pytest.raises(EOFError):
        tier.read_into("r/scattered", len(payload) - 4, [memoryview(bytearray(2))] * 3)


def test_read_into_past_the_end_or_of_a_missing_file_fails_cleanly(tier: Tier) -> None:
    tier.write_bytes("r/short", b"x" * 100)
    with pytest.raises(EOFError):
        tier.read_into("r/short", 50, memoryview(bytearray(80)))  # runs 30 bytes past the end
    with pytest.raises(EOFError):
        tier.read_into("r/short", 100, memoryview(bytearray(10)))  # starts at the end
    with pytest.raises(FileNotFoundError):
        tier.read_into("r/missing", 0, memoryview(bytearray(10)))


def test_missing_files_raise_file_not_found(tier: Tier) -> None:
    with pytest.raises(FileNotFoundError):
        tier.read_bytes("nope/missing")
    with pytest.raises(FileNotFoundError):
        tier.stat("nope/missing")
    assert not tier.exists("nope/missing")
    assert tier.list_dir("nope") == []
    assert tier.find("nope") == []


def test_listing(tier: Tier) -> None:
    tier.write_bytes("ck1/g1/x", b"1")
    tier.write_bytes("ck1/g1/y", b"22")
    tier.write_bytes("ck1/commit.json", b"{}")
    tier.write_bytes("ck2/z", b"333")
    assert tier.list_dir("") == ["ck1", "ck2"]
    assert tier.list_dir("ck1") == ["commit.json", "g1"]
    found = {f.path: f.size for f in tier.find("ck1")}
    assert found == {"ck1/commit.json": 2, "ck1/g1/x": 1, "ck1/g1/y": 2}
    assert {f.path for f in tier.find("")} == {*found, "ck2/z"}


def test_find_after_lists_what_find_does_past_a_name(tier: Tier) -> None:
    """The commit log's listing from a known number on (records/log.py)."""
    names = [f"log/{n:04d}~x" for n in (1, 2, 10, 11)] + ["log/0002", "logs/0100~x", "lo/9999"]
    for name in names:
        tier.write_bytes(name, b"")
    assert [f.path for f in tier.find("log", after="log/0002")] == ["log/0002~x", "log/0010~x", "log/0011~x"]
    assert [f.path for f in tier.find("log", after="log/0011~x")] == []
    assert tier.find("absent", after="absent/0") == []
    assert tier.find("log", after="log/") == [f for f in tier.find("log")]


def test_delete_and_delete_tree(tier: Tier) -> None:
    tier.write_bytes("d/keep", b"k")
    tier.write_bytes("d/sub/one", b"1")
    tier.write_bytes("d/sub/two", b"2")
    tier.delete("d/keep")
    tier.delete("d/keep")  # missing is fine
    assert not tier.exists("d/keep")
    tier.delete_tree("d/sub")
    tier.delete_tree("d/sub")
    assert tier.find("d") == []


def test_incomplete_write_is_invisible(tier: Tier) -> None:
    with pytest.raises(RuntimeError, match="crash mid-write"), tier.open_write("w/partial") as stream:
        stream.write(os.urandom(6 * 2**20))
        stream.write(b"more")
        assert not tier.exists("w/partial"), "a file must not be visible before it completes"
        raise RuntimeError("crash mid-write")
    assert not tier.exists("w/partial")
    assert tier.find("w") == []


def test_failed_overwrite_keeps_the_old_file(tier: Tier) -> None:
    tier.write_bytes("o/file", b"committed bytes")
    with pytest.raises(RuntimeError), tier.open_write("o/file") as stream:
        stream.write(b"half of a new ver")
        raise RuntimeError("interrupted")
    assert tier.read_bytes("o/file") == b"committed bytes"


def test_marker_publish_create_only(tier: Tier) -> None:
    tier.publish("m/commit.json", b'{"v": 1}', create_only=True)
    with pytest.raises(FileExistsError):
        tier.publish("m/commit.json", b'{"v": 2}', create_only=True)
    assert tier.read_bytes("m/commit.json") == b'{"v": 1}'
    tier.publish("m/commit.json", b'{"v": 3}', create_only=False)
    assert tier.read_bytes("m/commit.json") == b'{"v": 3}'


def test_describe_names_the_tier(tier: Tier) -> None:
    assert tier.name in tier.describe() and tier.type in tier.describe()


def test_find_in_children_lists_each_childs_named_file(tier: Tier) -> None:
    tier.write_bytes("ck1/commit.json", b"{}")
    tier.write_bytes("ck1/g1/commit.json", b"not a direct child's")
    tier.write_bytes("ck2/g1/x", b"no marker")
    tier.write_bytes("ck3/commit.json", b"{1}")
    found = tier.find_in_children("commit.json")
    assert sorted(found) == ["ck1", "ck3"]
    assert found["ck3"].size == 3 and found["ck3"].path == "ck3/commit.json"


def test_find_in_children_passes_over_the_child_it_is_told_to(tier: Tier) -> None:
    """The children whose keys sort before and after the one passed over (``.tierstore``, the
    commit log's, which S3 skips with one jump) are all found; it is not, though it holds ``name``."""
    children = ["-a", ".a", ".tierstore-b", ".tierstore0", "ck1"]
    for child in children:
        tier.write_bytes(f"{child}/commit.json", b"{}")
    for n in range(5):
        tier.write_bytes(f".tierstore/commits/{n:04d}", b"")
    tier.write_bytes(".tierstore/commit.json", b"{}")
    assert sorted(tier.find_in_children("commit.json", besides=".tierstore")) == sorted(children)
    assert ".tierstore" in tier.find_in_children("commit.json")


def test_incomplete_writes_are_listed_and_discarded(tier: Tier) -> None:
    writing = tier.open_write("inc/object")
    stream = writing.__enter__()
    stream.write(os.urandom(6 * 2**20))  # past one 5 MiB part: S3 has started a multipart upload
    stream.write(b"tail")
    try:
        assert tier.incomplete_writes(idle_for=3600.0, now=0.0) == [], "young writes are kept"
        listed = tier.incomplete_writes(idle_for=0.0, now=math.inf)
        if tier.local is not None or tier.type == "s3":
            assert listed, "an interrupted write leaves something, and the tier must list it"
        for write in listed:
            tier.discard_incomplete(write)
        assert tier.incomplete_writes(idle_for=0.0, now=math.inf) == []
        assert not tier.exists("inc/object")
    finally:  # the writer gives up; the error propagates (is not swallowed) and nothing appears
        assert not writing.__exit__(RuntimeError, RuntimeError("abandoned"), None)
    assert tier.find("inc") == []


def test_local_files_capability_maps_files_without_letting_writes_through(tier: Tier) -> None:
    """The peer mirror sends a stored file straight from its mapping (no copy, never the file
    itself changed); a tier without local files has no face for them, and callers ask for it."""
    if (local := local_face(tier)) is None:
        pytest.skip(f"{tier.type} declares no local files")
    payload = os.urandom(3 * 4096 + 5)
    tier.write_bytes("l/file", payload)
    view = local.map_file("l/file")
    assert bytes(view) == payload
    view[0] ^= 0xFF  # a private mapping: the byte changes in the view only
    assert tier.read_bytes("l/file") == payload
    tier.write_bytes("l/empty", b"")
    assert bytes(local.map_file("l/empty")) == b""
    with pytest.raises(FileNotFoundError):
        local.map_file("l/missing")
    with pytest.raises(FileNotFoundError):
        local.map_file("l/file/through-a-file")


def test_a_mapped_file_keeps_no_descriptor_and_is_not_inherited_by_a_forked_child(tier: Tier) -> None:
    """A trainer forks DataLoader workers while the mirror sends its files: a child inheriting the
    mapping, or a descriptor of the file, would hold the file's pages (host memory) after retention
    removes it, for as long as the worker lives."""
    if (local := local_face(tier)) is None:
        pytest.skip(f"{tier.type} declares no local files")
    tier.write_bytes("l/file", os.urandom(5 * 4096))
    inode = os.stat(tier.local_path("l/file")).st_ino  # type: ignore[attr-defined]
    view = local.map_file("l/file")
    assert inode in mapped_inodes(), "the view is a mapping of the file"
    assert inode not in open_inodes(), "the mapping keeps a descriptor of the file open"
    status = in_forked_child(lambda: 3 if inode in mapped_inodes() else 0, deadline=30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the forked child holds the file's mapping"
    assert bytes(view[:4096]) == tier.read_bytes("l/file")[:4096]
    del view
    assert inode not in mapped_inodes(), "the mapping outlived its last view"


def test_own_directory_is_locked_for_its_process_and_holds_its_files(tier: Tier) -> None:
    """A writer's staging directory: a real directory of the tier's filesystem, owned (cleanup
    sees its owner alive) until the lock is let go; a tier without local files has none."""
    if (local := local_face(tier)) is None:
        pytest.skip(f"{tier.type} declares no local files")
    home = local.own_directory("owned/a")
    try:
        Path(home.path, "slab").write_bytes(b"staged")
        assert tier.read_bytes("owned/a/slab") == b"staged"
        assert local.owner_alive("owned/a") is True
        with pytest.raises(OSError):
            local.own_directory("owned/a")  # another owner of the same directory is refused
    finally:
        os.close(home.lock)
    assert local.owner_alive("owned/a") is False, "the lock's holder let go: gone"


def test_adopt_capability_moves_a_file_in_and_recycle_one_out(tier: Tier, tmp_path: Path) -> None:
    if (local := local_face(tier)) is None:
        pytest.skip(f"{tier.type} cannot adopt files")
    home = local.own_directory("staging")
    os.close(home.lock)  # only its directory is needed here
    staged = os.path.join(home.path, "file")
    Path(staged).write_bytes(b"staged")
    local.adopt("a/file", staged)
    assert tier.read_bytes("a/file") == b"staged" and not Path(staged).exists()
    local.recycle("a/file", staged)  # out again, for reuse (a mirror's next landing file)
    assert not tier.exists("a/file") and Path(staged).read_bytes() == b"staged"
    local.adopt("a/file", staged)
    os.link(tier.local_path("a/file"), os.path.join(home.path, "second-name"))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="one name"):  # its bytes would change under the other
        local.recycle("a/file", staged)
    assert tier.read_bytes("a/file") == b"staged"


def test_a_child_forked_while_a_file_lands_holds_no_descriptor_of_it(tier: Tier) -> None:
    """A mirror's receive keeps its landing file open for the whole transfer: a DataLoader worker
    forked meanwhile must not keep the file (and its pages) after retention removes it."""
    if (local := local_face(tier)) is None:
        pytest.skip(f"{tier.type} cannot adopt files")
    for spare in (False, True):
        reserved = None
        if spare:
            home = local.own_directory("landing-spares")
            os.close(home.lock)
            reserved = os.path.join(home.path, "spare")
            Path(reserved).write_bytes(b"\0" * 8192)
        landing = local.open_landing(f"l/landed-{spare}", 8192, reserved)
        inode = os.stat(landing.temp).st_ino
        assert inode in open_inodes(), "the landing is open while it receives"
        status = in_forked_child(lambda inode=inode: 3 if inode in open_inodes() else 0, deadline=30)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"the forked child holds the landing file open (spare: {spare})"
        )
        landing.write_at(0, memoryview(b"x" * 8192))
        local.adopt(f"l/landed-{spare}", landing.seal())
        assert tier.read_bytes(f"l/landed-{spare}") == b"x" * 8192
        assert inode not in open_inodes(), "the sealed landing left its descriptor open"


def test_remove_if_empty_never_removes_content(tier: Tier) -> None:
    local = local_face(tier)  # object stores have no empty directories: nothing to remove
    tier.write_bytes("e/full/file", b"x")
    if local is not None:
        local.remove_if_empty("e/full")
    assert tier.read_bytes("e/full/file") == b"x"
    tier.delete("e/full/file")
    if local is not None:
        local.remove_if_empty("e/full")
        local.remove_if_empty("e/missing")
    assert tier.list_dir("e") == []


def test_space_is_the_filesystems_usage_or_none_where_a_tier_cannot_tell(tier: Tier) -> None:
    if (local := local_face(tier)) is None:
        return  # no filesystem whose space it could report
    space = local.space()  # before the first write too: the root need not exist yet
    assert space is not None and 0 < space.used <= space.total
    assert 0 <= space.free <= space.total - space.used
    tier.write_bytes("s/file", b"x")
    assert local.space() is not None


def test_an_empty_file_reads_as_empty(tier: Tier) -> None:
    """A zero-byte file (a commit-log entry, a marker cut to nothing) reads as ``b""``: S3 answers
    a ranged GET of an empty object with 416, which must not read as an unavailable tier."""
    tier.write_bytes("e/empty", b"")
    assert tier.read_bytes("e/empty") == b""
    assert b"".join(tier.iter_chunks("e/empty")) == b""
    assert tier.stat("e/empty").size == 0


def test_a_missing_file_read_in_chunks_is_file_not_found(tier: Tier) -> None:
    """The promotion's copy reads every source through iter_chunks: a missing source (or a path
    through a foreign file) must say so, not yield nothing."""
    with pytest.raises(FileNotFoundError):
        next(iter(tier.iter_chunks("gone/file")))
    tier.write_bytes("plain", b"a file where a directory would be")
    with pytest.raises(FileNotFoundError):
        next(iter(tier.iter_chunks("plain/file")))


def test_owner_locks_where_the_tier_has_local_files(tier: Tier) -> None:
    """Cleanup asks the tier whether a staging directory's owner runs (its lock is a local file)."""
    if (local := local_face(tier)) is None:
        return
    assert local.directory_mtime("owners/a") is None
    tier.write_bytes("owners/a/slab", b"x")
    assert local.owner_alive("owners/a") is None, "no lock file: the caller judges by age"
    mtime = local.directory_mtime("owners/a")
    assert mtime is not None and abs(mtime - tier.stat("owners/a/slab").mtime) < 1
    home = local.own_directory("owners/b")
    try:
        assert local.owner_alive("owners/b") is True
    finally:
        os.close(home.lock)
    assert local.owner_alive("owners/b") is False, "the lock's holder let go: gone"
