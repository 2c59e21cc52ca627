"""Cleaning up what no commit marker covers: uncommitted generations, temp files, stale uploads.

Only things that no marker (or, on a non-coordinator node, no part record) refers to are touched, and
only once they have been left alone for ``promote.stale_after``: a save or a promotion in progress keeps
writing, so its files stay young. Committed checkpoints are removed only by retention.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime

from tierstore.discovery import Source
from tierstore.ids import (
    MARKER_NAME,
    PARTS_DIR,
    is_checkpoint_id,
    is_generation,
    staging_dir,
)
from tierstore.leases import stale_leases
from tierstore.owners import owner_is_gone
from tierstore.tiers import Tier
from tierstore.tiers.posix import PosixTier
from tierstore.tiers.s3 import S3Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cleanup:
    """Something to remove from ``tier``: ``kind`` is ``tree``, ``file`` or ``upload``."""

    tier: str
    kind: str
    path: str
    reason: str
    upload_id: str = ""


def find_leftovers(
    tier: Tier, sources: dict[str, Source], *, stale_after: float, now: float | None = None
) -> list[Cleanup]:
    """Everything in ``tier`` that gc would remove now, with the reason."""
    now = time.time() if now is None else now
    found: list[Cleanup] = []
    newest: dict[tuple[str, str], float] = {}
    with_parts: set[tuple[str, str]] = set()
    marked: set[str] = set()
    for info in tier.find(""):
        parts = info.path.split("/")
        if len(parts) == 2 and parts[1] == MARKER_NAME:
            marked.add(parts[0])
        if len(parts) >= 3 and is_checkpoint_id(parts[0]) and is_generation(parts[1]):
            key = (parts[0], parts[1])
            newest[key] = max(newest.get(key, 0.0), info.mtime)
            if parts[2] == PARTS_DIR:
                with_parts.add(key)
    for (checkpoint_id, generation), mtime in sorted(newest.items()):
        known = sources.get(checkpoint_id)
        if known is not None and known.copy.generation == generation:
            continue
        if checkpoint_id in marked and known is None:
            continue  # a marker we could not read this time: its data is not ours to judge
        if tier.node_local and (checkpoint_id, generation) in with_parts:
            continue  # another node's committed part looks the same as a failed one: retention decides
        idle = now - mtime
        if idle >= stale_after:
            why = "generation not named by the marker" if known else "no commit marker"
            found.append(Cleanup(tier.name, "tree", f"{checkpoint_id}/{generation}",
                                 f"{why}; untouched for {idle:.0f}s"))  # fmt: skip
    if isinstance(tier, PosixTier):
        for info in tier.find_temporary(""):
            if now - info.mtime >= stale_after:
                found.append(
                    Cleanup(tier.name, "file", info.path, "temporary file of an interrupted write")
                )
    if isinstance(tier, PosixTier):
        for owner in tier.list_dir(staging_dir()):
            # A writer touches its directory at every save; in another PID namespace (a sidecar
            # container) its pid is invisible, so age is required as well as a missing process.
            directory = tier.local_path(f"{staging_dir()}/{owner}")
            if owner_is_gone(owner) and now - os.stat(directory).st_mtime >= stale_after:
                found.append(Cleanup(tier.name, "tree", f"{staging_dir()}/{owner}",
                                     "staging buffers of a writer process that is gone"))  # fmt: skip
    if isinstance(tier, S3Tier):
        for upload in tier.list_uploads():
            started: datetime | None = upload.get("Initiated")
            age = now - started.timestamp() if started else stale_after
            if age >= stale_after:
                age = now - tier.last_activity(upload, default=now - age)
            if age >= stale_after:
                reason = f"incomplete multipart upload, {age:.0f}s old"
                found.append(
                    Cleanup(
                        tier.name, "upload", str(upload["Key"]), reason, str(upload["UploadId"])
                    )
                )
    for path in stale_leases(tier, now):
        found.append(Cleanup(tier.name, "file", path, "read lease of a reader that is gone"))
    return found


def remove(tier: Tier, cleanup: Cleanup) -> None:
    """Carry out one cleanup."""
    if cleanup.kind == "tree":
        tier.delete_tree(cleanup.path)
    elif cleanup.kind == "file":
        tier.delete(cleanup.path)
    elif cleanup.kind == "upload" and isinstance(tier, S3Tier):
        key = cleanup.path
        tier.call("abort_multipart_upload", f"abort {key}", Bucket=tier.bucket, Key=key,
                  UploadId=cleanup.upload_id)  # fmt: skip


__all__ = ["Cleanup", "find_leftovers", "remove"]
