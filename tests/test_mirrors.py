"""Mirror records at rest: the mirror marker, the owner's status, retention of a partner's mirrors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tierstore.checksum import crc32c
from tierstore.config import Config, config_from_dict
from tierstore.dcp.mirror.inventory import unheld
from tierstore.errors import ConfigError, IntegrityError
from tierstore.ids import mirror_commit_path, mirror_copy_path, mirror_marker_path
from tierstore.promote.cleanup import find_leftovers, remove
from tierstore.records.activity import hold as hold_activity
from tierstore.records.activity import live
from tierstore.records.marker import FileEntry, Manifest
from tierstore.records.mirror import (
    MirrorMarker,
    MirrorStatus,
    held_mirrors,
    mirrored_commits,
    mirrored_ids,
    read_status,
    write_status,
)
from tierstore.records.mirror_retention import prune_mirrors
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.tiers.memory import MemoryTier


def mirrored(tmp_path: Path, **mirror: object) -> Config:
    return config_from_dict(
        {"tiers": [{"name": "m", "type": "memory", "path": str(tmp_path), "mirror": mirror or True}]}
    )


def memory(tmp_path: Path, **mirror: object) -> Tier:
    return mirrored(tmp_path, **mirror).make_tier("m", node=0)


def hold(tier: Tier, checkpoint_id: str, seq: int, owner: int = 1) -> MirrorMarker:
    """Leave a complete mirror of ``owner``'s one file of ``checkpoint_id`` in ``tier``."""
    gen = f"g{seq:011x}00000000"
    entry = FileEntry(f"{gen}/r00001-0.distcp", 3, 0x12345678, 1, owner)
    tier.publish(mirror_copy_path(checkpoint_id, entry.path), b"abc", create_only=False)
    blob = Manifest(checkpoint_id, gen, 2, (entry,), seq=seq).to_json()
    tier.publish(mirror_commit_path(checkpoint_id, gen), blob, create_only=False)
    marker = MirrorMarker(checkpoint_id, gen, owner, 0, (1,), (entry,), seq, crc32c(blob), {})
    tier.publish(mirror_marker_path(checkpoint_id, gen, owner), marker.to_json(), create_only=False)
    return marker


def test_mirror_marker_round_trips(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    marker = hold(tier, "step_1", 1)
    assert held_mirrors(tier, "step_1") == [marker]
    assert mirrored_ids(tier) == {"step_1": 1}


def test_a_malformed_mirror_marker_names_itself() -> None:
    with pytest.raises(IntegrityError, match="where-it-was: malformed mirror marker"):
        MirrorMarker.from_json(b'{"format": "tierstore.mirror/1"}', where="where-it-was")


def test_retention_keeps_the_keep_newest_ids_whoever_owns_them(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    for seq in (1, 2, 3):
        hold(tier, f"step_{seq}", seq)
    hold(tier, "step_0", 0, owner=5)  # the old partner of a node that left the job
    assert prune_mirrors(tier, keep=None) == [], "no keep: the memory tier keeps everything"
    removed = prune_mirrors(tier, keep=2)
    assert sorted(r.split("/")[0] for r in removed) == ["step_0", "step_1"]
    assert sorted(mirrored_ids(tier)) == ["step_2", "step_3"]
    assert not (tmp_path / ".tierstore" / "mirror" / "step_1").exists(), "files go with the marker"


def test_an_overwritten_generations_mirror_is_stale_and_never_takes_a_keep_slot(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    hold(tier, "step_1", 1)
    old = hold(tier, "step_2", 2)
    new = hold(tier, "step_2", 3)  # step_2 overwritten: a newer generation
    prune_mirrors(tier, keep=2)
    assert [m.generation for m in held_mirrors(tier, "step_2")] == [new.generation]
    assert old.generation != new.generation and mirrored_ids(tier) == {"step_1": 1, "step_2": 3}


def test_retention_leaves_an_id_a_restore_is_reading(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    for seq in (1, 2):
        hold(tier, f"step_{seq}", seq)
    reading = hold_activity(tier, "read", "step_1", None, ttl=60)
    try:
        readers = [a for a in live(tier, ttl=60) if a.kind == "read"]
        assert prune_mirrors(tier, keep=1, readers=readers) == []
    finally:
        reading.release()
    assert [r.split("/")[0] for r in prune_mirrors(tier, keep=1)] == ["step_1"]


def test_a_mirror_without_its_marker_does_not_count(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    marker = hold(tier, "step_1", 1)
    tier.delete(mirror_marker_path("step_1", marker.generation, 1))
    assert held_mirrors(tier, "step_1") == [] and mirrored_ids(tier) == {}


def test_status_round_trips(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    status = MirrorStatus("step_1", "g00000000001aaaaaaaa", 0, 1, False, "peer died")
    write_status(tier, status)
    assert read_status(tier, "step_1", status.generation, 0) == status
    assert read_status(tier, "step_1", status.generation, 1) is None


def test_mirror_config_shorthand_and_errors(tmp_path: Path) -> None:
    mirror = mirrored(tmp_path, stride=2, timeout="30s").mirror_of("m")
    assert mirror is not None and (mirror.stride, mirror.timeout) == (2, 30.0)
    base = {"name": "m", "type": "memory", "path": str(tmp_path)}
    assert config_from_dict({"tiers": [{**base, "mirror": False}]}).tiers[0].mirror is None
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.mirror\.stride: expected a value >= 1"):
        config_from_dict({"tiers": [{**base, "mirror": {"stride": 0}}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.mirror\.peers: unknown key 'peers'"):
        config_from_dict({"tiers": [{**base, "mirror": {"peers": 2}}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.mirror: expected a mapping, got 'yes'"):
        config_from_dict({"tiers": [{**base, "mirror": "yes"}]})
    two = [{**base, "name": "a", "mirror": True}, {**base, "name": "b", "mirror": True}]
    with pytest.raises(ConfigError, match=r"tiers: mirror is set on tiers \['a', 'b'\]"):
        config_from_dict({"tiers": two})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.mirror: unknown key"):
        config_from_dict({"tiers": [{"name": "l", "type": "local", "path": str(tmp_path), "mirror": True}]})


def test_gc_removes_a_mirror_cut_short_once_stale_and_never_a_complete_one(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    complete = hold(tier, "step_1", 1)
    cut = hold(tier, "step_2", 2)
    tier.delete(mirror_marker_path("step_2", cut.generation, 1))  # the exchange died before it
    now = time.time()
    fresh = find_leftovers(tier, stale_after=600, activity_ttl=60, now=now, trust=MarkerTrust())
    assert [c.path for c in fresh if "mirror" in c.path] == [], "a recent exchange may be running"
    later = find_leftovers(tier, stale_after=600, activity_ttl=60, now=now + 601, trust=MarkerTrust())
    stale = [c for c in later if "mirror" in c.path]
    assert [c.path for c in stale] == [f".tierstore/mirror/step_2/{cut.generation}"]
    remove(tier, stale[0], trust=MarkerTrust())
    assert held_mirrors(tier, "step_1") == [complete]
    assert not (tmp_path / ".tierstore" / "mirror" / "step_2" / cut.generation).exists()


def test_an_unheld_file_names_where_its_mirror_belonged() -> None:
    gen = "g00000000001aaaaaaaa"
    files = (FileEntry(f"{gen}/r00000-0.distcp", 3, 1, 0, 0), FileEntry(f"{gen}/r00001-0.distcp", 3, 2, 1, 1))
    topology = {"hosts": {"0": "a", "1": "b"}, "mirror_stride": 1}
    manifest = Manifest("step_1", gen, 2, files, seq=1, topology=topology)
    lines = unheld(manifest, {0: {files[0].path: "own"}})
    assert len(lines) == 1
    assert "r00001-0.distcp (saved by rank 1 on node 1; its mirror belongs on saving node 0)" in lines[0]
    assert Manifest.from_json(manifest.to_json(), where="x").topology == topology


def test_a_changed_copy_of_a_commit_marker_is_never_believed(tmp_path: Path) -> None:
    tier = memory(tmp_path)
    marker = hold(tier, "step_1", 1)
    copy = tmp_path / mirror_commit_path("step_1", marker.generation)
    copy.write_bytes(copy.read_bytes().replace(b'"seq": 1', b'"seq": 9'))  # a flipped digit
    assert mirrored_commits(tier, "step_1") == [] and mirrored_ids(tier) == {}


class _RecordingTier(MemoryTier):
    """A real memory tier that notes each removal, in order (the ordering rule's witness)."""

    def __init__(self, root: Path) -> None:
        super().__init__("m", str(root))
        self.removed: list[str] = []

    def delete(self, path: str) -> None:
        self.removed.append(path)
        super().delete(path)

    def delete_tree(self, path: str) -> None:
        self.removed.append(f"{path}/")
        super().delete_tree(path)


def test_a_mirror_is_removed_marker_first_then_its_files(tmp_path: Path) -> None:
    marker = hold(memory(tmp_path), "step_1", 1)
    tier = _RecordingTier(tmp_path)
    prune_mirrors(tier, keep=0)
    gen = marker.generation
    assert tier.removed[:2] == [mirror_marker_path("step_1", gen, 1), f".tierstore/mirror/step_1/{gen}/"], (
        "a reader that sees the marker must find every file it names"
    )
    assert held_mirrors(memory(tmp_path), "step_1") == []


def test_mirror_tags_count_per_sender_and_receiver_and_never_collide_within_a_pair() -> None:
    from tierstore.dcp.mirror.rounds import SavedShare, plan_transfers
    from tierstore.dcp.mirror.transport import CHUNK
    from tierstore.placement import place

    def share(rank: int) -> SavedShare:
        files = tuple(
            FileEntry(f"g/r{rank}-{i}.distcp", 3 * CHUNK + 1, 0, rank=rank, node=rank) for i in range(2)
        )
        return SavedShare("step_1", "g", 1, rank, rank, f"host{rank}", files, True, rank == 0)

    shares = [share(rank) for rank in range(4)]
    transfers = plan_transfers(shares, place({r: f"host{r}" for r in range(4)}), first_tag=7)
    spans: dict[tuple[int, int], list[range]] = {}
    for t in transfers:
        span = range(t.first_tag, t.first_tag + -(-t.entry.size // CHUNK))
        spans.setdefault((t.sender, t.receiver), []).append(span)
    assert len(spans) == 4, spans  # every node sends to its partner: (0,1), (1,0), (2,3), (3,2)
    for pair, ranges in spans.items():
        # Each pair's tags start at first_tag (the span bounds one pair's bytes, not the job's)...
        assert ranges[0].start == 7, (pair, ranges)
        # ...and one pair's files never share a tag.
        assert ranges[0].stop <= ranges[1].start, (pair, ranges)
