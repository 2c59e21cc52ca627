"""latest_committed and the catalog: decided by markers; newest is commit order (the commit log),
never the step in the id or a clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import Catalog, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.ids import COMMITS_DIR, SIGHTINGS_DIR, marker_path, newest_first, step_of
from tierstore.records.log import read_log
from tierstore.records.marker import read_manifest
from tierstore.records.protocol import claim
from tierstore.signing import MarkerTrust
from tierstore.tiers import FileInfo, make_tier
from tierstore.tiers.posix import PosixTier


def test_step_parsing() -> None:
    assert step_of("step_000200") == 200
    assert step_of("run3-epoch2-step1500") == 1500
    assert step_of("final") is None


def test_newest_first_rule() -> None:
    ordered = newest_first([("step_10", 2), ("step_9", 5), ("final", 4), ("legacy", None)])
    assert ordered == ["step_9", "final", "step_10", "legacy"], "commit order; unlogged last"


def _save(config: Config, checkpoint_id: str, tier: str | None = None) -> None:
    dcp.save(
        {"x": torch.arange(4)}, storage_writer=TieredWriter(config, tier=tier), checkpoint_id=checkpoint_id
    )


def test_latest_across_tiers_and_none_when_empty(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local", "s3")
    assert latest_committed(config) is None
    _save(config, "step_000100")
    _save(config, "step_000300", tier="s3")
    _save(config, "step_000200", tier="local")
    assert latest_committed(config) == "step_000200", "committed last: the newest"
    scanned = Catalog(config).scan()
    assert scanned.keys() == {"step_000100", "step_000200", "step_000300"}
    assert set(scanned["step_000300"]) == {"s3"}


def test_directories_without_markers_do_not_count(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    _save(config, "step_000001")
    _save(config, "step_000002")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    tier.delete(marker_path("step_000002"))
    tier.write_bytes("step_000009/gdeadbeef00/junk", b"no marker here")
    assert latest_committed(config) == "step_000001"


def test_corrupt_newest_marker_is_skipped(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    _save(config, "step_000001")
    _save(config, "step_000002")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    tier.publish(marker_path("step_000002"), b"garbage", create_only=False)
    assert latest_committed(config) == "step_000001"


def seqs(config: Config) -> dict[str, int | None]:
    held: dict[str, int | None] = {}
    for tier in config.make_tiers(node=0):
        for checkpoint_id in Catalog(config).scan():
            if tier.exists(marker_path(checkpoint_id)):
                held[checkpoint_id] = read_manifest(tier, checkpoint_id, trust=MarkerTrust()).seq
    return held


def test_ids_whose_last_number_is_not_the_step_order_as_committed(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    names = ["step100_20240601", "ckpt-000500-v1", "step100_bf16", "final"]
    for name in names:
        _save(config, name)
    assert [e.checkpoint_id for e in Catalog(config).listings()] == names[::-1]
    assert latest_committed(config) == "final"


def test_a_rollback_makes_the_new_saves_newest(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    for step in (100, 200, 300):
        _save(config, f"step_{step:06d}")
    _save(config, "step_000110")  # resumed from step 100 after a loss spike; 200, 300 abandoned
    assert latest_committed(config) == "step_000110"
    assert seqs(config) == {"step_000100": 1, "step_000200": 2, "step_000300": 3, "step_000110": 4}


@pytest.mark.slow  # a multi-step scenario of several seconds: make test runs it
def test_tier_saves_and_a_wiped_first_tier_keep_the_sequence_growing(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", "s3")
    memory, s3 = config.make_tiers(node=0)
    _save(config, "step_000001")
    _save(config, "step_000002", tier="s3")
    _save(config, "step_000003")
    memory.delete_tree("")  # the node was replaced: its host memory is empty
    _save(config, "step_000004")
    held = seqs(config)  # newer than everything that survived (step 3 went with the memory)
    assert held.keys() == {"step_000002", "step_000004"}
    assert (held["step_000004"] or 0) > (held["step_000002"] or 0) == 2
    assert [e.seq for e in read_log(s3)] == [2]
    assert latest_committed(config) == "step_000004"


def test_a_marker_without_its_log_entry_still_counts_in_its_markers_order(
    make_config: Callable[..., Config],
) -> None:
    """A promotion that stopped between its marker and its log entry (or a copy from before the
    log) leaves a marker the log does not know: it is still a copy, ordered by its marker's seq."""
    config = make_config("memory", "local")
    memory, _local = config.make_tiers(node=0)
    _save(config, "step_000001")
    _save(config, "step_000002", tier="local")
    _save(config, "step_000003")
    newest = read_manifest(memory, "step_000003", trust=MarkerTrust())
    for entry in read_log(memory):  # as if the log entry had never been written
        if (entry.checkpoint_id, entry.generation) == ("step_000003", newest.generation):
            memory.delete(entry.path)
    assert "step_000003" not in {e.checkpoint_id for e in read_log(memory)}
    assert list(Catalog(config).candidates()) == ["step_000003", "step_000002", "step_000001"]
    assert latest_committed(config) == "step_000003"


def test_an_overwrite_in_flight_keeps_the_id_at_its_committed_place(
    make_config: Callable[..., Config],
) -> None:
    """An overwrite claims a newer number before its marker: until that marker replaces the old
    one, the id stays where its committed generation's number puts it."""
    config = make_config("memory")
    (memory,) = config.make_tiers(node=0)
    _save(config, "step_000001")
    _save(config, "step_000002")
    claim(memory, "step_000001", "g" + "f" * 19)  # the overwrite's number: the highest
    assert list(Catalog(config).candidates()) == ["step_000002", "step_000001"]
    assert latest_committed(config) == "step_000002"


class _NoDataListing(PosixTier):
    """A tier that fails the test if anything lists below the root recursively (data files); the
    commit log and the sightings are tierstore's own small directories."""

    def find(self, path: str = "", *, after: str | None = None) -> list[FileInfo]:
        if not path.startswith((COMMITS_DIR, SIGHTINGS_DIR)):
            raise AssertionError(f"listed data files under {path!r}")
        return super().find(path, after=after)


def test_finding_the_newest_lists_no_data_files(make_config: Callable[..., Config]) -> None:
    """Its cost is one listing of the commit log and one of the top-level ids per tier, not one
    listing of every rank's files of every checkpoint (a request per 1000 objects in S3)."""
    config = make_config("local")
    for step in (1, 2, 3):
        _save(config, f"step_{step:06d}")
    (tier,) = config.make_tiers(node=0)
    assert isinstance(tier, PosixTier)
    watched = _NoDataListing(tier.name, tier.type, tier.root, node_local=True)
    assert next(Catalog(config, tiers=[watched]).candidates()) == "step_000003"


def test_ids_held_where_the_tiers_cannot_see_are_placed_at_their_seq(
    make_config: Callable[..., Config],
) -> None:
    """Peer mirrors on other nodes: ``also`` adds ids at the seq they hold, the higher one wins."""
    config = make_config("memory")
    _save(config, "step_000001")
    _save(config, "step_000002")
    order = Catalog(config).candidates(also={"step_000009": 5, "step_000001": 7})
    assert list(order) == ["step_000001", "step_000009", "step_000002"]
