"""A tier's copies as its keeper's index gives them (promote/discovery.py ``indexed``) are the copies
a listing gives: the same ids, commit numbers, generations, provenance, conflicts and save starts,
so that the policy and the duties decide alike on either."""

from __future__ import annotations

from collections.abc import Callable

from tests.simulated_job import manifest_for
from tierstore.config import Config
from tierstore.ids import INDEX_PATH, marker_path
from tierstore.promote.discovery import MarkerCache, discover, index_of, indexed, marker_of
from tierstore.promote.sidecar import Promoter
from tierstore.records.changes import read_stamp
from tierstore.records.conflicts import Conflict, record_conflict
from tierstore.records.index import decode, encode, read_index
from tierstore.signing import MarkerTrust


def test_a_view_built_from_the_index_equals_the_listing(make_config: Callable[..., Config]) -> None:
    (tier,) = make_config("shared").make_tiers(node=0)
    manifests = [manifest_for(i, 2, "") for i in range(1, 6)]
    manifests[1] = manifests[1].with_changes(provenance={"tier": "fast"}, overwrite=True)
    manifests[2] = manifests[2].with_changes(unseen_tiers=("s3",), timings={"started_at": 1234.5})
    manifests[3] = manifests[3].with_changes(seq=None, overwrite=False)
    for manifest in manifests:
        tier.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    first = manifests[0]
    record_conflict(tier, Conflict(first.checkpoint_id, first.generation, 1, "s3", "gother", 9, "raced"))
    listed = discover(tier, MarkerCache(MarkerTrust()))
    assert listed[first.checkpoint_id].copy.conflicts == {"s3"}

    from_index = indexed(decode(encode(index_of(b"t", listed, 5, []))))

    assert {i: s.copy for i, s in from_index.items()} != {i: s.copy for i, s in listed.items()}, (
        "the conflicts come from the index's records: none given, none marked"
    )
    records = [Conflict(first.checkpoint_id, first.generation, 1, "s3", "gother", 9, "raced")]
    from_index = indexed(decode(encode(index_of(b"t", listed, 5, records))))
    assert {i: s.copy for i, s in from_index.items()} == {i: s.copy for i, s in listed.items()}
    assert {i: s.started_at for i, s in from_index.items()} == {i: s.started_at for i, s in listed.items()}
    assert from_index[manifests[2].checkpoint_id].started_at == 1234.5
    assert all(s.committed and s.manifest is None for s in from_index.values())
    # what needs the manifest reads the marker: the one the listing read
    for checkpoint_id, seen in from_index.items():
        assert marker_of(seen, tier, MarkerTrust()) == listed[checkpoint_id].manifest


def test_the_keeper_indexes_each_fresh_listing_with_the_token_read_before_it(
    make_config: Callable[..., Config],
) -> None:
    """A promoter that keeps the shared tier leaves its index after each pass's listing: the stamp
    it read before listing, and the copies that listing showed; a pass that reused its listing
    (nothing changed) writes nothing."""
    config = make_config("local", "shared")
    _local, shared = config.make_tiers(node=0)
    for index in range(1, 4):
        manifest = manifest_for(index, 2, "")
        shared.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    keeper = Promoter(config)
    keeper.run_once()  # lists, indexes; then stamps the tier once per process
    assert keeper.context.keepers.kept() == {"shared"}
    first = read_index(shared)
    assert first is not None and first.token != read_stamp(shared), "indexed before the restamp"
    keeper.run_once()  # the stamp changed: listed again, indexed under the new token
    second = read_index(shared)
    assert second is not None and second.token == read_stamp(shared)
    assert {c.checkpoint_id for c in second.copies} == set(keeper.view.found["shared"])
    assert second.highest == keeper.view.highest["shared"]
    blob = shared.read_bytes(INDEX_PATH)
    keeper.run_once()  # nothing changed: the listing is reused, the index left as it is
    assert "shared" in keeper.view.reused and shared.read_bytes(INDEX_PATH) == blob
