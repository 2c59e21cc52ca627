"""Two promotions replacing one id's marker in one target at the same time, with different generations.

A replacing promotion judged the target's marker (older: REPLACE), then logged and swapped. A second
promotion of a newer commit of the id that swapped the marker in between was overwritten by the first
one's swap: the target then named the older commit over the newer one that had committed there, whose
data was left without a marker (found by an adversarial review of the log-before-swap order). The
swap now first checks that the marker still names the generation it judged; if not, the promotion is
judged again against what stands. The race is staged deterministically: the second promotion runs
whole the moment the first one logs its number, through a target that acts on that write.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.ids import COMMITS_DIR, checkpoint_file
from tierstore.promote.job import promoted_manifest, publish_committed
from tierstore.promote.sidecar import Promoter
from tierstore.records.log import read_log
from tierstore.records.marker import Manifest, read_manifest
from tierstore.records.protocol import Verdict
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.tiers.posix import PosixTier


def _save(config: Config, value: float, *, tier: str | None = None) -> None:
    writer = TieredWriter(config, tier=tier, overwrite=True)
    dcp.save({"w": torch.full((4,), value)}, storage_writer=writer, checkpoint_id="x")


def _copied(source: Tier, target: Tier) -> Manifest:
    """A promotion's copy of x's files from ``source``; returns the marker it would publish."""
    manifest = read_manifest(source, "x", trust=MarkerTrust())
    for entry in manifest.files:
        path = checkpoint_file("x", entry.path)
        target.write_bytes(path, source.read_bytes(path))
    return promoted_manifest(manifest, source, durable=True)


class _ActsOnFirstLogEntry(PosixTier):
    """The target, in which another promoter acts the moment this one writes a commit-log entry."""

    def __init__(self, tier: PosixTier, action: Callable[[], None]) -> None:
        super().__init__(tier.name, tier.type, tier.root, node_local=tier.node_local)
        self.action: Callable[[], None] | None = action

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        if path.startswith(f"{COMMITS_DIR}/") and self.action is not None:
            action, self.action = self.action, None
            action()
        super().publish(path, data, create_only=create_only)


def test_a_swap_does_not_put_an_older_commit_over_a_newer_one_swapped_in_meanwhile(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("memory", "local", "shared")
    memory, local, shared = config.make_tiers(node=0)
    _save(config, 1.0)
    assert Promoter(config).run(once=True) == 0  # x's first commit in every tier
    _save(config, 2.0, tier="local")  # an overwrite straight into local (seq 2)
    _save(config, 3.0)  # and a newer one into memory (seq 3)
    older, newer = _copied(local, shared), _copied(memory, shared)
    assert (older.seq, newer.seq) == (2, 3)

    def newer_promotion() -> None:
        verdict, _existing = publish_committed(shared, newer, source_tier="memory", trust=MarkerTrust())
        assert verdict is Verdict.REPLACE

    assert isinstance(shared, PosixTier)
    watched = _ActsOnFirstLogEntry(shared, newer_promotion)
    verdict, existing = publish_committed(watched, older, source_tier="local", trust=MarkerTrust())
    assert watched.action is None, "the other promotion ran inside this one"
    assert read_manifest(shared, "x", trust=MarkerTrust()).generation == newer.generation
    assert verdict is Verdict.KEEP_NEWER and existing is not None
    assert existing.generation == newer.generation
    logged = {e.generation for e in read_log(shared) if e.checkpoint_id == "x"}
    assert logged == {newer.generation}, "neither the judged marker's nor the swap's entry stays"
