"""One load by one rank, from ``read_metadata`` to the end of ``read_data`` (the reader keeps only
what outlives a load). Its ``read`` records, one in each tier whose copy the choice may take
(fastest first, only as far as needed; not in a slower tier it only asks for a newer commit), keep
cleanup and retention off the checkpoint until the data is in memory; every rank holds its own:
ranks finish at different times, and DCP tells a rank nothing after its own ``read_data``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any

from tierstore._platform.bounded import Prober
from tierstore._platform.health import said_once
from tierstore.config import Config
from tierstore.dcp.collectives import rank_and_world
from tierstore.dcp.layout import ItemLocation
from tierstore.dcp.mirror import stored_path
from tierstore.dcp.restore.choice import Choice
from tierstore.ids import checkpoint_file
from tierstore.records.activity import Activity, hold
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, is_host_memory

logger = logging.getLogger("tierstore.dcp.reader")
"""The restore's logger, every step's: the name users configure (see examples/quickstart.py)."""


@dataclasses.dataclass(eq=False)
class RestoreSession:
    """One load by one rank: the reader's settings, then what the choice fills in."""

    config: Config
    tiers: list[Tier]
    node: int
    verify: bool
    trust: MarkerTrust  # the markers it reads: the job's namespace, signed by its keys
    collective: bool
    process_group: Any  # the group passed to dcp.load, None (the default one) or collectives.ALONE
    prober: Prober  # the reader's: a tier found hung is skipped by its later loads
    checkpoint_id: str
    reading: dict[str, Activity] = dataclasses.field(default_factory=dict)  # read records, by tier
    began: float = dataclasses.field(default_factory=time.monotonic)
    bytes_read: int = 0
    choice: Choice | None = None
    tier: Tier | None = None
    storage: dict[Any, ItemLocation] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def count(self, nbytes: int) -> None:
        """Bytes read from storage by this load (on several threads)."""
        with self._lock:
            self.bytes_read += nbytes

    def hold(self, index: int, read: bool = False) -> None:
        """Announce the restore in ``tiers[index]`` before the tier is looked at.

        A tier that cannot take the record is logged and still considered: the restore itself says
        whether it is usable. ``read``: the coordinator read the copy's marker there, and this rank
        may read the copy: it is asked even where this process's view skips the tier (a rank whose
        own earlier question failed would otherwise read the copy with no record of its own).
        """
        tier = self.tiers[index]
        if tier.name in self.reading:
            return
        announce = functools.partial(
            hold, tier, "read", self.checkpoint_id, None, ttl=self.config.promote.activity_ttl
        )
        try:  # within probe_timeout: a hung tier must not hold the restore (a late one is undone)
            self.reading[tier.name] = self.prober.ask(
                tier,
                announce,
                what="announce the restore",
                on_late=Activity.release,
                direct=is_host_memory(tier),
                anyway=read,
            )
        except Exception as exc:  # noqa: BLE001 - the restore decides what is usable
            logger.log(
                said_once(tier),
                "could not announce the restore of %s in %s: %s",
                self.checkpoint_id,
                tier.name,
                exc,
            )

    def stop_reading(self, keep: str | None = None) -> None:
        """Release the ``read`` records (all, or all but the tier called ``keep``)."""
        for name in [n for n in self.reading if n != keep]:
            self.reading.pop(name).release()

    def stored(self, rel: str) -> str:
        """Tier-relative path of a file the chosen copy's marker names, as this node holds it."""
        choice = self.choice
        if choice is None or choice.holdings is None:
            return checkpoint_file(self.checkpoint_id, rel)
        rank, _ = rank_and_world(self.process_group)
        mine: dict[str, str] = choice.holdings.get(choice.rank_nodes[rank], {})
        return stored_path(self.checkpoint_id, rel, mine.get(rel, "own"))
