"""What a process knows of the tiers it does not save into: read once, at start-up, with a deadline.

A save asks only its own tier (DESIGN.md, "Tiers stand alone"). What it must know of the others — the
ids committed there and the highest commit number — it learns from three places:

1. **Start-up**: the first save of the process lists each other tier once (its commit log and its
   markers, in parallel, each bounded by ``probe_timeout``). A tier that does not answer is
   *unreachable at start-up*; it is not asked again by this process.
2. **Sightings** (:mod:`tierstore.records.sightings`): what the promoter last saw in the other tiers,
   recorded in the target tier, read at every save.
3. **This process's own commits**, into any tier (a ``tier=`` save, then a save of the same id into
   another tier, in one process).

A tier that neither start-up nor a sighting covers is *unseen* by the save; its marker says so
(``unseen_tiers``), and the promoter never lets such a save replace, or be replaced by, another content
of the id in that tier: it keeps both and reports a conflict (:mod:`tierstore.records.conflicts`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tierstore.bounded import Prober
from tierstore.ids import MARKER_NAME, is_checkpoint_id
from tierstore.records.log import read_log
from tierstore.records.sightings import Sighting
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """An id committed in another tier: where, and at which commit number (None: unknown)."""

    tier: str
    seq: int | None
    generation: str = ""
    """Known for this process's own commits; '' when learnt from a listing."""


def list_commits(tier: Tier) -> tuple[int, dict[str, int | None]]:
    """``(highest commit number, {id: its newest logged number})`` of the ids committed in ``tier``:
    two listings (the commit log, the top-level markers), no marker read."""
    logged: dict[str, int] = {}
    highest = 0
    for entry in read_log(tier):
        highest = max(highest, entry.seq)
        logged[entry.checkpoint_id] = max(logged.get(entry.checkpoint_id, 0), entry.seq)
    committed = [c for c in tier.find_in_children(MARKER_NAME) if is_checkpoint_id(c)]
    return highest, {c: logged.get(c) for c in committed}


class Elsewhere:
    """One process's knowledge of a namespace's tiers (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.looked_at: set[str] = set()
        """Tiers listed at start-up (answered or not)."""
        self.unreachable: dict[str, str] = {}
        """``{tier: why}`` for the tiers that did not answer at start-up."""
        self.highest = 0
        self.ids: dict[str, Held] = {}
        self._own: dict[str, Held] = {}

    def look(self, tiers: Iterable[Tier], prober: Prober) -> None:
        """List the given tiers not looked at yet (in parallel, each within the prober's deadline).

        No lock is held while asking (a fork meanwhile must not inherit a held lock); two threads
        asking at once both ask, and both answers are merged.
        """
        with self._lock:
            todo = [t for t in tiers if t.name not in self.looked_at]
        if not todo:
            return
        with ThreadPoolExecutor(len(todo)) as pool:
            answers = list(pool.map(lambda t: self._ask(t, prober), todo))
        with self._lock:
            for tier, answer in zip(todo, answers, strict=True):
                self.looked_at.add(tier.name)
                if isinstance(answer, str):
                    self.unreachable[tier.name] = answer
                    continue
                highest, ids = answer
                self.highest = max(self.highest, highest)
                for checkpoint_id, seq in ids.items():
                    self.ids.setdefault(checkpoint_id, Held(tier.name, seq))
        for tier, answer in zip(todo, answers, strict=True):
            if isinstance(answer, str):
                logger.warning(
                    "tier %s is unreachable at start-up (%s): saves into other tiers go on; ids"
                    " that exist only there are unknown to them until the promoter sees that tier"
                    " again",
                    tier.name,
                    answer,
                )

    @staticmethod
    def _ask(tier: Tier, prober: Prober) -> tuple[int, dict[str, int | None]] | str:
        try:
            return prober.ask(tier.name, lambda: list_commits(tier), what="list its commits")
        except Exception as exc:  # noqa: BLE001 - an unreachable tier is what this records
            return f"{type(exc).__name__}: {exc}"

    def committed(self, tier_name: str, checkpoint_id: str, seq: int, generation: str) -> None:
        """This process committed ``checkpoint_id`` (``generation``) as ``seq`` in ``tier_name``."""
        with self._lock:
            self._own[checkpoint_id] = Held(tier_name, seq, generation)
            self.highest = max(self.highest, seq)

    def own_commit(self, checkpoint_id: str) -> tuple[str, int | None, str] | None:
        """``(tier, seq, generation)`` of this process's last commit of the id, or None."""
        with self._lock:
            held = self._own.get(checkpoint_id)
        return None if held is None else (held.tier, held.seq, held.generation)

    def holder(
        self, checkpoint_id: str, *, besides: str, sightings: dict[str, Sighting]
    ) -> str | None:
        """A tier other than ``besides`` known to hold ``checkpoint_id`` (start-up, sightings, this
        process's commits), or None."""
        with self._lock:
            for held in (self._own.get(checkpoint_id), self.ids.get(checkpoint_id)):
                if held is not None and held.tier != besides:
                    return held.tier
        for name, sighting in sightings.items():
            if name != besides and checkpoint_id in sighting.ids:
                return name
        return None

    def highest_known(self, sightings: dict[str, Sighting]) -> int:
        """The highest commit number known outside the target (start-up, sightings, own commits)."""
        with self._lock:
            return max([self.highest, *(s.highest for s in sightings.values())])

    def unseen(self, target: str, sightings: dict[str, Sighting]) -> list[str]:
        """Tiers a save into ``target`` knows nothing of: unreachable at start-up, never sighted."""
        with self._lock:
            return sorted(n for n in self.unreachable if n != target and n not in sightings)


_KNOWN: dict[tuple[str, ...], Elsewhere] = {}
_KNOWN_LOCK = threading.Lock()


def elsewhere_for(tiers: list[Tier]) -> Elsewhere:
    """This process's :class:`Elsewhere` for the namespace these tiers (as configured) hold."""
    key = tuple(f"{t.name}={t.root}" for t in tiers)
    with _KNOWN_LOCK:
        return _KNOWN.setdefault(key, Elsewhere())
