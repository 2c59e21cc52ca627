"""A restore's ``read`` records: held in each tier the choice looks at, until the data is in memory.

Cleanup and retention leave a checkpoint alone while a live ``read`` record names it. Every rank
holds its own, in each tier the choice looks at (fastest first, only as far as needed): ranks finish
reading at different times, and DCP tells a rank nothing after its own ``read_data``.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from tierstore.records.activity import Activity, hold

if TYPE_CHECKING:
    from tierstore.dcp.reader import TieredReader

# The restore's lines keep the logger name users configure for it (see examples/quickstart.py).
logger = logging.getLogger("tierstore.dcp.reader")


def hold_read(reader: TieredReader, index: int) -> None:
    """Announce the restore in ``reader.tiers()[index]`` before the tier is looked at.

    A tier that cannot take the record is logged and still considered: the restore itself says
    whether it is usable.
    """
    tier = reader.tiers()[index]
    if tier.name in reader._reading or reader._checkpoint_id is None:
        return
    announce = functools.partial(
        hold, tier, "read", reader._checkpoint_id, None, ttl=reader.config.promote.activity_ttl
    )
    try:  # within probe_timeout: a hung tier must not hold the restore (a late one is undone)
        reader._reading[tier.name] = reader._prober.ask(
            tier.name,
            announce,
            what="announce the restore",
            on_late=Activity.release,
            direct=tier.capabilities.staging_files,
        )
    except Exception as exc:  # noqa: BLE001 - the restore decides what is usable
        logger.warning(
            "could not announce the restore of %s in %s: %s", reader._checkpoint_id, tier.name, exc
        )


def stop_reading(reader: TieredReader, keep: str | None = None) -> None:
    """Release the ``read`` records (all, or all but the tier called ``keep``)."""
    for name in [n for n in reader._reading if n != keep]:
        reader._reading.pop(name).release()
