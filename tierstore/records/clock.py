"""The tier's clock: what time it is *where the file times are stamped*, so that no age compares two
hosts' clocks.

Every age that can lead to a deletion (an activity record's, a leftover's) is ``now`` minus a file time
the tier stamped, so ``now`` is taken from the tier itself (:func:`tier_now`): a small probe file
written there, its time read back, the probe deleted. Where a process orders its own knowledge against
a record another host wrote, it reads the record's time as the tier stamped it, moved onto its own
clock (:func:`clock_offset`). Times written inside records are for people and metrics. The limit
(filesystems whose clients stamp file times): docs/operations.md, "Clocks".
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
