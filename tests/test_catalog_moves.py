"""The newest checkpoint while copies move between tiers: a promotion (marker, then log entry), an
eviction (marker, data, then log entry) and overwrites leave logs and markers that disagree for a
while; the catalog still places every committed id by the commit that made its generation."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from tierstore import Catalog, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.ids import MARKER_NAME, checkpoint_file, marker_path
from tierstore.promote.job import promoted_manifest, publish_committed
from tierstore.promote.retention import delete_copy
from tierstore.records.log import highest_in, read_log
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.protocol import claim
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.tiers.posix import PosixTier


def _save(config: Config, checkpoint_id: str, tier: str | None = None, *, overwrite: bool = False) -> None:
    writer = TieredWriter(config, tier=tier, overwrite=overwrite)
    dcp.save({"x": torch.arange(4)}, storage_writer=writer, checkpoint_id=checkpoint_id)


def _copied(source: Tier, target: Tier, checkpoint_id: str) -> Manifest:
    """A promotion's copy of the files; returns the marker it would publish."""
    manifest = read_manifest(source, checkpoint_id, trust=MarkerTrust())
    for entry in manifest.files:
        path = checkpoint_file(checkpoint_id, entry.path)
        target.write_bytes(path, source.read_bytes(path))
    return promoted_manifest(manifest, source, durable=True)


def _promote_then_evict(memory: Tier, local: Tier, checkpoint_id: str) -> Callable[[], None]:
    def run() -> None:
        publish_committed(
            local, _copied(memory, local, checkpoint_id), source_tier=memory.name, trust=MarkerTrust()
        )
        delete_copy(memory, checkpoint_id, trust=MarkerTrust())

    return run


class _ActsOnFirstMarkerRead(PosixTier):
    """A memory tier in which another process acts the moment the catalog first reads a marker:
    after every tier's listings, before any marker (the race's window, made deterministic)."""

    def __init__(self, tier: PosixTier, action: Callable[[], None]) -> None:
        super().__init__(tier.name, tier.type, tier.root, node_local=tier.node_local)
        self.action: Callable[[], None] | None = action

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if path.endswith(f"/{MARKER_NAME}") and self.action is not None:
            action, self.action = self.action, None
            action()
        return super().read_range(path, offset, length)


def _watched(memory: Tier, action: Callable[[], None]) -> _ActsOnFirstMarkerRead:
    assert isinstance(memory, PosixTier)
    return _ActsOnFirstMarkerRead(memory, action)


def test_an_overwrite_promoted_and_evicted_meanwhile_keeps_its_place(
    make_config: Callable[..., Config],
) -> None:
    """``latest`` was committed at seq 3 throughout (in memory, then in local); local's log still
    lists only its old generation's entry (seq 1) when the catalog reads it."""
    config = make_config("memory", "local")
    memory, local = config.make_tiers(node=0)
    _save(config, "latest")
    _promote_then_evict(memory, local, "latest")()
    _save(config, "step_000002")
    _save(config, "latest", overwrite=True)
    assert {e.checkpoint_id: e.seq for e in read_log(memory)} == {"step_000002": 2, "latest": 3}
    assert [e.seq for e in read_log(local)] == [1]
    watched = _watched(memory, _promote_then_evict(memory, local, "latest"))
    order = list(Catalog(config, node=0, tiers=[watched, local]).candidates())
    assert read_manifest(local, "latest", trust=MarkerTrust()).seq == 3, (
        "the promotion happened in the window"
    )
    assert order == ["latest", "step_000002"]


def test_an_id_with_several_entries_none_of_its_markers_generation_is_placed_by_its_seq(
    make_config: Callable[..., Config],
) -> None:
    """Local holds a failed overwrite's claim and an old entry; its marker is a promoted newer
    generation whose promoter stopped before logging it: the marker's seq places it."""
    config = make_config("memory", "local")
    memory, local = config.make_tiers(node=0)
    _save(config, "step_000001", tier="local")
    claim(local, "step_000001", "g" + "e" * 19, floor=highest_in(memory))  # a failed overwrite's number
    _save(config, "step_000003")
    _save(config, "step_000001", overwrite=True)
    copied = _copied(memory, local, "step_000001")  # its marker put as a promoter's publish puts it
    local.publish(marker_path("step_000001"), copied.to_json(), create_only=False)
    delete_copy(memory, "step_000001", trust=MarkerTrust())  # the promoter stopped before its log entry
    assert len([e for e in read_log(local) if e.checkpoint_id == "step_000001"]) == 2
    assert list(Catalog(config).candidates()) == ["step_000001", "step_000003"]
    assert latest_committed(config) == "step_000001"


def test_an_overwrite_of_an_id_with_several_entries_promoted_meanwhile_keeps_its_place(
    make_config: Callable[..., Config],
) -> None:
    """Only saves, overwrites, one whole promotion and an eviction, racing the catalog."""
    config = make_config("memory", "local")
    memory, local = config.make_tiers(node=0)
    _save(config, "ckpt", tier="local")
    _save(config, "ckpt", tier="local", overwrite=True)  # the first entry stays until cleanup
    _save(config, "step_000003")
    _save(config, "ckpt", overwrite=True)
    watched = _watched(memory, _promote_then_evict(memory, local, "ckpt"))
    assert list(Catalog(config, tiers=[watched, local]).candidates()) == ["ckpt", "step_000003"]
