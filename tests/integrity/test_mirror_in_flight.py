"""A peer mirror being received: cleanup leaves it alone, and its marker never covers a hole."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable

import pytest

from tests.tiers.dict_tier import DictTier
from tierstore.config import Config
from tierstore.errors import IntegrityError
from tierstore.ids import mirror_copy_path, mirror_marker_path
from tierstore.promote.cleanup import Cleanup, find_leftovers
from tierstore.records.activity import held
from tierstore.records.marker import FileEntry
from tierstore.records.mirror import MirrorMarker
from tierstore.records.protocol import land_mirror as publish_mirror
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

GEN = "g0000000000010000000"


def receive_part_of_a_mirror(tier: Tier) -> MirrorMarker:
    """One of two files of node 1's mirror received (quiet for a minute); the other still due."""
    tier.write_bytes(mirror_copy_path("step_1", f"{GEN}/r00001-0.distcp"), b"x" * 64)
    path = tier.local_path(mirror_copy_path("step_1", f"{GEN}/r00001-0.distcp"))
    assert path is not None
    os.utime(path, (time.time() - 60, time.time() - 60))
    files = (
        FileEntry(f"{GEN}/r00001-0.distcp", 64, 0, 1, 1),
        FileEntry(f"{GEN}/r00001-1.distcp", 8, 0, 1, 1),
    )
    return MirrorMarker("step_1", GEN, 1, 0, (1,), files, 3, 0)


def test_cleanup_leaves_a_mirror_being_received_alone(make_config: Callable[..., Config]) -> None:
    tier = make_config("memory").make_tiers(node=0)[0]
    receive_part_of_a_mirror(tier)

    def mirrors() -> list[Cleanup]:
        found = find_leftovers(tier, stale_after=1.0, activity_ttl=60.0, trust=MarkerTrust())
        return [c for c in found if c.path.startswith(".tierstore/mirror/")]

    with held(tier, "write", "step_1", GEN):
        assert mirrors() == [], "the receiving exchange announces it"
    assert [c.path for c in mirrors()] == [f".tierstore/mirror/step_1/{GEN}"], "cut short: removed"


def test_a_mirror_marker_is_never_published_over_a_missing_file(make_config: Callable[..., Config]) -> None:
    tier = make_config("memory").make_tiers(node=0)[0]
    marker = receive_part_of_a_mirror(tier)
    with pytest.raises(IntegrityError, match=r"r00001-1.distcp: missing"):
        publish_mirror(tier, b"{}", marker)
    assert not tier.exists(mirror_marker_path("step_1", GEN, 1))


class HoleAtPublish(DictTier):
    """A store where another actor removes a received file just as the mirror marker lands."""

    victim = ""

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        super().publish(path, data, create_only=create_only)
        if "/mirror-node" in path and self.victim:
            self.delete(self.victim)


def test_a_mirror_marker_over_a_file_removed_as_it_was_published_is_withdrawn() -> None:
    """Files checked, marker published, files checked again: a marker over a hole is taken back."""
    tier = HoleAtPublish("memory", f"hole-{uuid.uuid4().hex[:8]}", None)
    entries = (FileEntry(f"{GEN}/r00001-0.distcp", 64, 0, 1, 1),)
    for entry in entries:
        tier.write_bytes(mirror_copy_path("step_1", entry.path), b"x" * entry.size)
    tier.victim = mirror_copy_path("step_1", entries[0].path)
    marker = MirrorMarker("step_1", GEN, 1, 0, (1,), entries, 3, 0)
    with pytest.raises(IntegrityError, match=r"while its mirror marker was published"):
        publish_mirror(tier, b"{}", marker)
    assert not tier.exists(mirror_marker_path("step_1", GEN, 1))
