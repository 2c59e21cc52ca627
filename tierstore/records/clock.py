"""The tier's clock: what time it is *where the file times are stamped*, so that no age compares two
hosts' clocks.

Cleanup and retention judge ages: an activity record not refreshed for ``activity_ttl`` belongs to a
holder that is gone; a leftover untouched for ``stale_after`` is abandoned. Each age is ``now`` minus a
file time, and the file time was stamped by the tier: a node's kernel for ``memory`` and ``local``,
the server for S3 (``LastModified``) and NFS. Taking ``now`` from this host's ``time.time()`` would mix
two clocks: a promoter whose clock runs an hour ahead of the tier would see a live save's record, last
refreshed seconds ago, as an hour old, and its files as abandoned. So every age that can lead to a
deletion takes ``now`` from the tier itself (:func:`tier_now`): a small probe file written there, its
time read back, the probe deleted. The observer's own clock then does not matter at all.

What stays clock-dependent: a shared filesystem whose *clients* stamp file times (Lustre does) stamps
each file with its writer's clock, the probe included; there the clocks of the hosts writing the tier
must agree within half of ``activity_ttl`` (see docs/operations.md, "Clocks"), as such filesystems
require anyway. Where a process orders its own knowledge against a record another host wrote (a
promoter's sighting against its own start-up look), it reads the record's time as the tier stamped
it, moved onto its own clock (:func:`clock_offset`), never the time the writer put inside. Times
written inside records (a marker's ``committed_at``, a sighting's ``seen_at`` as written) are for
people and metrics.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from tierstore.ids import clock_probe_path
from tierstore.tiers import Tier


def tier_now(tier: Tier) -> float:
    """The current time by ``tier``'s clock (epoch seconds), as it would stamp a file written now.

    One small write, one stat and one delete. Take it *before* listing what it is compared with: a
    file written after the probe then looks younger than it is, never older. An object store's
    times may be whole seconds, so this may be up to a second early (ages err young, the safe way).

    Raises what the tier raises when it cannot be written (an observer that cannot probe the tier
    must not delete there by its own clock instead).
    """
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:64]
    path = clock_probe_path(f"{host or 'host'}~{os.getpid()}~{uuid.uuid4().hex[:12]}")
    tier.write_bytes(path, b"")
    try:
        return tier.stat(path).mtime
    finally:
        tier.delete(path)


def clock_offset(tier: Tier) -> float:
    """How far this host's clock is ahead of ``tier``'s (seconds; negative: behind), to within the
    time a probe takes and the tier's time resolution. A file time ``t`` from the tier is
    ``t + clock_offset(tier)`` on this host's clock: comparable with this process's own times."""
    before = time.time()
    at = tier_now(tier)
    return (before + time.time()) / 2 - at


__all__ = ["clock_offset", "tier_now"]
