"""A tier's copies as its keeper's index gives them (promote/discovery.py ``indexed``) are the copies
a listing gives: the same ids, commit numbers, generations, provenance, conflicts and save starts,
so that the policy and the duties decide alike on either."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.simulated_job import manifest_for
from tierstore.config import Config
from tierstore.ids import INDEX_PATH, marker_path
from tierstore.promote.discovery import MarkerCache, discover, index_of, indexed, marker_of
from tierstore.promote.sidecar import Promoter
from tierstore.records.changes import read_stamp, touch
from tierstore.records.conflicts import Conflict, record_conflict
from tierstore.records.index import decode, encode, read_index, write_index
from tierstore.records.lease import Holder, Lease, claim, renew
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


def test_a_watcher_lists_without_an_index_and_keeps_its_listing_while_the_index_is_behind(
    make_config: Callable[..., Config],
) -> None:
    """A node whose shared tier another node keeps (its lease renewed by the test): after a change,
    with no index at all it lists the tier as before (a keeper of an older release writes none);
    with an index made under an older stamp it keeps its listing, and sees the change once the
    index holds the stamp it reads."""
    lease_s = 0.5  # every read of the lease finds it renewed (the test renews first): never stale
    config = make_config("local", "shared", promote={"keeper_lease": f"{lease_s}s", "interval": "1h"})
    shared = config.make_tiers(node=0)[1]
    elsewhere = Holder(0, "another-host", "pidns", 1, "their-token", time.time())
    held = [Lease(1, elsewhere)]
    assert claim(shared, held[0])

    def renew_lease() -> None:  # the keeper on another host, alive: it names the stamp it read
        held[0] = held[0].renewed(read_stamp(shared))
        renew(shared, held[0])

    def save(index: int) -> str:
        manifest = manifest_for(index, 2, "")
        shared.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
        touch(shared)
        return manifest.checkpoint_id

    def watcher_pass() -> set[str]:
        time.sleep(lease_s)  # the stamp of a tier kept elsewhere is read once a lease
        renew_lease()
        watcher.run_once()
        return set(watcher.view.found["shared"])

    first = save(1)
    watcher = Promoter(config, node=1)
    assert watcher_pass() == {first}
    assert set(watcher.context.keepers.watched()) == {"shared"}
    second = save(2)
    assert watcher_pass() == {first, second}, "no index: listed"

    stale = index_of(read_stamp(shared), watcher.view.found["shared"], 2, [])
    write_index(shared, stale)
    third = save(3)
    assert watcher_pass() == {first, second}, "the index is behind: the kept listing"
    renew_lease()
    watcher.run_once()  # asked again at the very next pass, not a lease later
    assert set(watcher.view.found["shared"]) == {first, second}
    write_index(shared, index_of(read_stamp(shared), discover(shared, MarkerCache(MarkerTrust())), 3, []))
    renew_lease()
    watcher.run_once()
    assert set(watcher.view.found["shared"]) == {first, second, third}, "the index caught up"
    assert set(watcher.context.keepers.watched()) == {"shared"}
