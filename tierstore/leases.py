"""Read leases: a restore in progress tells retention not to delete what it is reading.

A lease is a small file ``.tierstore/leases/<id>~<random>.lease`` in the tier being read. Retention
skips any checkpoint with a live lease; a lease older than :data:`LEASE_TTL` (a reader that crashed) is
ignored and removed by gc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator

from tierstore.ids import LEASE_DIR, lease_path, leased_checkpoint
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
LEASE_TTL = 3600.0


@contextlib.contextmanager
def read_lease(tier: Tier, checkpoint_id: str) -> Iterator[None]:
    """Hold a lease on ``checkpoint_id`` in ``tier`` for the duration of the block (best effort)."""
    path = lease_path(checkpoint_id, uuid.uuid4().hex[:12])
    body = {"pid": os.getpid(), "host": socket.gethostname(), "at": time.time()}
    try:
        tier.write_bytes(path, json.dumps(body).encode())
    except Exception as exc:  # noqa: BLE001 - a lease protects against gc; reading still works
        logger.warning("could not take a read lease on %s in %s: %s", checkpoint_id, tier.name, exc)
        path = ""
    try:
        yield
    finally:
        if path:
            with contextlib.suppress(Exception):
                tier.delete(path)


def leased_ids(tier: Tier, now: float | None = None) -> set[str]:
    """Checkpoint ids with a live lease in ``tier``."""
    now = time.time() if now is None else now
    return {
        checkpoint_id
        for info in tier.find(LEASE_DIR)
        if (checkpoint_id := leased_checkpoint(info.path)) and now - info.mtime < LEASE_TTL
    }


def stale_leases(tier: Tier, now: float) -> list[str]:
    """Lease files of readers that are gone (older than the TTL)."""
    return [i.path for i in tier.find(LEASE_DIR) if now - i.mtime >= LEASE_TTL]
