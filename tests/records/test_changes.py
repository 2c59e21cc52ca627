"""The change stamp comes after the change (records/changes.py): a promoter that looks at the tier
right after any stamp its actor writes, and then again, must see the change. Were a stamp written
before its change, the look right after it would list the tier without the change and keep that
listing under the new token: the promoter would not see the change until its next full listing.

The tier is a test-only POSIX type whose stamp writes call the promoter's look once written (the
exact interleaving: nothing in tierstore is patched)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tests.simulated_job import BLOB, manifest_for
from tierstore.config import config_from_dict
from tierstore.ids import CHANGES_PATH
from tierstore.promote.sidecar import Promoter
from tierstore.records.protocol import claim, drop, publish
from tierstore.signing import MarkerTrust
from tierstore.tiers import RetryHook
from tierstore.tiers.posix import PosixTier, PosixTierConfig, join_namespace
from tierstore.tiers.registry import config_model, register

AFTER_STAMP: list[Callable[[], object]] = []
"""Called once each stamp is written (the promoter's look)."""


class LookedAtTier(PosixTier):
    """A shared directory whose every stamp write is followed by :data:`AFTER_STAMP`'s calls."""

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        super().publish(path, data, create_only=create_only)
        if path == CHANGES_PATH:
            for look in list(AFTER_STAMP):
                look()


if config_model("looked-at") is None:

    @register
    class LookedAtTierConfig(PosixTierConfig):
        """``type: looked-at``: a shared directory looked at after every stamp (tests only)."""

        type: Literal["looked-at"]

        def build(
            self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None
        ) -> LookedAtTier:
            return LookedAtTier(
                self.name, "looked-at", join_namespace(self.path, namespace), node_local=False
            )


def test_a_promoter_looking_right_after_each_stamp_sees_every_change_at_its_next_look(tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "tiers": [{"name": "pfs", "type": "looked-at", "path": str(tmp_path / "pfs")}],
            "promote": {"full_scan": "1h"},
        }
    )
    (tier,) = config.make_tiers(node=0)
    promoter = Promoter(config, node=0)
    promoter.catalog()
    manifest = manifest_for(1, 2, "")
    checkpoint_id = manifest.checkpoint_id
    AFTER_STAMP.append(promoter.catalog)
    try:
        for entry in manifest.files:  # a save: its files, its number, its marker
            tier.write_bytes(f"{checkpoint_id}/{entry.path}", BLOB)
        seq = claim(tier, checkpoint_id, manifest.generation)
        assert (
            publish(tier, manifest.with_changes(seq=seq), replace=False, log=False, trust=MarkerTrust())
            is None
        )
    finally:
        AFTER_STAMP.clear()
    assert checkpoint_id in promoter.catalog()["pfs"], "the commit"
    assert promoter.view.highest["pfs"] == seq, "the log entry"
    AFTER_STAMP.append(promoter.catalog)
    try:
        drop(tier, checkpoint_id, manifest.generation, trust=MarkerTrust())
    finally:
        AFTER_STAMP.clear()
    assert checkpoint_id not in promoter.catalog()["pfs"], "the drop"
