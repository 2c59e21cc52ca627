"""What a process knows of the tiers it does not save into: read once, at start-up, with a deadline.

A save asks only its own tier (DESIGN.md, "Tiers stand alone"). What it must know of the others — the
ids committed there and the highest commit number — it learns from three places:

1. **Start-up**: the first save of the process lists each other tier once (its commit log and its
   markers, in parallel, each bounded by ``probe_timeout``). A tier that does not answer is
   *unreachable at start-up*; it is not asked again by this process. The markers are listed even
   where a keeper's index stands for them: a marker whose writer died before stamping the tier is
   missing from an index made under the same stamp, and the look is what refuses a second save of
   its id.
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
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tierstore._platform.bounded import Prober
from tierstore._platform.health import said_once
from tierstore._platform.runtime import ProcessLocal
from tierstore.errors import IntegrityError
from tierstore.ids import INTERNAL_DIR, MARKER_NAME, is_checkpoint_id
from tierstore.records.log import highest_in, read_head, read_log_and_voids
from tierstore.records.marker import read_manifest
from tierstore.records.sightings import Sighting
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


BLIND_JUMP = 10**9
"""How far above everything it knows a process numbers its commits when a tier it could not see at
start-up has never been sighted either: that tier's commits (the job's earlier checkpoints) predate
this process, so this process's commits must rank newer than any of them, whatever their numbers."""


OUTCOMES = 16
"""How many of its recent saves' outcomes a coordinator tells the other nodes at each save."""


@dataclass(frozen=True)
class Held:
    """An id committed in another tier: where, and at which commit number (None: unknown)."""

    tier: str
    seq: int | None
    """None for an id learnt from the start-up look: it learns which ids, not their numbers."""
    generation: str = ""
    """Known for this process's own commits; '' when learnt from a listing."""
    at: float = 0.0
    """When it was learnt (the look, or the commit): a sighting taken later supersedes it."""


def list_commits(tier: Tier, trust: MarkerTrust) -> tuple[int, set[str]]:
    """``(highest commit number, ids committed)`` in ``tier``: the markers' listing, the head
    record and the log above it (:mod:`tierstore.records.log`), a marker read only for an id the
    log does not know (with ``trust``).

    A promotion logs its number after publishing the marker: a crash or power cut between the two
    leaves a marker the log does not know. Its number still counts towards the highest, or the next
    save (after its first tier was wiped) would take that number again and not rank newest. Where
    the head record says every marker was logged, only the log above it is listed and no marker
    is read: such a marker's number is then known from the tier it was promoted from."""
    committed = {c for c in tier.find_in_children(MARKER_NAME, besides=INTERNAL_DIR) if is_checkpoint_id(c)}
    head = read_head(tier)
    if head is not None and head.logged:
        return highest_in(tier, above=head.seq), committed
    log, voids = read_log_and_voids(tier)
    logged = {entry.checkpoint_id for entry in log}
    unlogged = [seq for c in committed - logged if (seq := _marker_seq(tier, c, trust)) is not None]
    return max([log[-1].seq if log else 0, *voids, *unlogged]), committed


def _marker_seq(tier: Tier, checkpoint_id: str, trust: MarkerTrust) -> int | None:
    """The commit number in the id's marker; None if it is gone or unreadable (not a copy)."""
    try:
        return read_manifest(tier, checkpoint_id, trust=trust).seq
    except (FileNotFoundError, IntegrityError):
        return None


class Elsewhere:
    """One process's knowledge of a namespace's tiers (see the module docstring). Thread-safe.

    Of two sources about one tier, the more recent decides: the start-up look, the promoter's
    sighting (``seen_at``, on this process's clock: see
    :func:`~tierstore.records.sightings.read_sightings`), this process's own commit. So an id
    retention deleted since the look is not refused once a later sighting lacks it, and a sighting
    taken before this process's own ``tier=`` commit does not hide that commit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.looked_at: dict[str, float] = {}
        """Tiers listed at start-up (answered or not), and when."""
        self.unreachable: dict[str, str] = {}
        """``{tier: why}`` for the tiers that did not answer at start-up."""
        self.highest = 0
        """The highest commit number the start-up look found (own commits aside)."""
        self.ids: dict[str, Held] = {}
        self._own: dict[str, Held] = {}
        self._failed: dict[tuple[str, str], str] = {}
        """``{(id, generation): tier}`` of this process's saves that failed to commit, or whose
        commit an overwrite replaced and dropped (the latest ``4 * OUTCOMES``)."""

    def look(self, tiers: Iterable[Tier], prober: Prober, trust: MarkerTrust) -> None:
        """List the given tiers not looked at yet (in parallel, each within the prober's deadline;
        markers read with ``trust``).

        No lock is held while asking (a fork meanwhile must not inherit a held lock); two threads
        asking at once both ask, and both answers are merged.
        """
        with self._lock:
            todo = [t for t in tiers if t.name not in self.looked_at]
        if not todo:
            return
        at = time.time()
        with ThreadPoolExecutor(len(todo)) as pool:
            answers = list(pool.map(lambda t: self._ask(t, prober, trust), todo))
        with self._lock:
            for tier, answer in zip(todo, answers, strict=True):
                self.looked_at[tier.name] = at
                if isinstance(answer, str):
                    self.unreachable[tier.name] = answer
                    continue
                highest, ids = answer
                self.highest = max(self.highest, highest)
                for checkpoint_id in ids:
                    self.ids.setdefault(checkpoint_id, Held(tier.name, None, at=at))
        for tier, answer in zip(todo, answers, strict=True):
            if isinstance(answer, str):
                logger.log(
                    said_once(tier),
                    "tier %s is unreachable at start-up (%s): saves into other tiers go on; ids"
                    " that exist only there are unknown to them until the promoter sees that tier"
                    " again",
                    tier.name,
                    answer,
                )

    @staticmethod
    def _ask(tier: Tier, prober: Prober, trust: MarkerTrust) -> tuple[int, set[str]] | str:
        try:
            return prober.ask(tier, lambda: list_commits(tier, trust), what="list its commits")
        except Exception as exc:  # noqa: BLE001 - an unreachable tier is what this records
            return f"{type(exc).__name__}: {exc}"

    def committed(self, tier_name: str, checkpoint_id: str, seq: int, generation: str) -> None:
        """This process committed ``checkpoint_id`` (``generation``) as ``seq`` in ``tier_name``."""
        with self._lock:
            self._own[checkpoint_id] = Held(tier_name, seq, generation, time.time())

    def failed(self, tier_name: str, checkpoint_id: str, generation: str) -> None:
        """This process's save of ``checkpoint_id`` (``generation``) into ``tier_name`` did not
        commit (no marker names it), or its commit was replaced there and dropped (an overwrite)."""
        with self._lock:
            self._failed[(checkpoint_id, generation)] = tier_name
            while len(self._failed) > 4 * OUTCOMES:  # a long job's replaced generations: the latest
                del self._failed[next(iter(self._failed))]

    def outcomes(self, tier_name: str) -> list[tuple[str, str, int | None]]:
        """``(id, generation, seq)`` of this process's most recent commits into ``tier_name`` and
        ``(id, generation, None)`` of its saves there that failed or were replaced and dropped:
        what a coordinator tells the other nodes at its next save
        (:func:`tierstore.records.protocol.settle_parts`)."""
        with self._lock:
            own = [(i, h.generation, h.seq) for i, h in self._own.items() if h.tier == tier_name]
            failed = [(i, g, None) for (i, g), t in self._failed.items() if t == tier_name]
        own.sort(key=lambda o: o[2] or 0, reverse=True)
        return [*own[:OUTCOMES], *failed[-OUTCOMES:]]

    def _current(self, held: Held | None, sightings: dict[str, Sighting]) -> Held | None:
        """``held`` unless a sighting of its tier was taken after it was learnt."""
        if held is None:
            return None
        sighting = sightings.get(held.tier)
        return None if sighting is not None and sighting.seen_at > held.at else held

    def own_commits(self, sightings: dict[str, Sighting]) -> dict[str, tuple[str, int | None, str]]:
        """``{id: (tier, seq, generation)}`` of this process's last commit of each id, where no
        later sighting of its tier supersedes it."""
        with self._lock:
            own = list(self._own.items())
        return {
            i: (h.tier, h.seq, h.generation)
            for i, held in own
            if (h := self._current(held, sightings)) is not None
        }

    def holder(self, checkpoint_id: str, *, besides: str, sightings: dict[str, Sighting]) -> str | None:
        """A tier other than ``besides`` known to hold ``checkpoint_id`` (this process's commits,
        the start-up look, sightings: per tier, the most recent of them), or None."""
        with self._lock:
            own, looked = self._own.get(checkpoint_id), self.ids.get(checkpoint_id)
            looked_at = dict(self.looked_at)
        for held in (self._current(own, sightings), self._current(looked, sightings)):
            if held is not None and held.tier != besides:
                return held.tier
        for name, sighting in sightings.items():
            if name == besides or looked_at.get(name, 0.0) > sighting.seen_at:
                continue  # this process's look at that tier is more recent than the sighting
            if checkpoint_id in sighting.ids:
                return name
        return None

    def highest_known(self, target: str, sightings: dict[str, Sighting]) -> int:
        """The floor of a commit number claimed in ``target``: the highest known outside it (start-up
        look, sightings), or, while some tier is unseen (unreachable at start-up, never sighted),
        :data:`BLIND_JUMP` above that: this process is newer than anything that tier holds; and at
        least this process's own highest commit (into any tier). Once the target's own log is above
        the floor (the first such commit), numbers simply go on: the jump is taken once."""
        with self._lock:
            known = max([self.highest, *(s.highest for s in sightings.values())])
            own = max((h.seq or 0 for h in self._own.values()), default=0)
        return max(known + (BLIND_JUMP if self.unseen(target, sightings) else 0), own)

    def unseen(self, target: str, sightings: dict[str, Sighting]) -> list[str]:
        """Tiers a save into ``target`` knows nothing of: unreachable at start-up, never sighted."""
        with self._lock:
            return sorted(n for n in self.unreachable if n != target and n not in sightings)


_KNOWN: ProcessLocal[dict[tuple[str, ...], Elsewhere]] = ProcessLocal(dict)
"""This process's knowledge per set of tiers; a forked child starts knowing nothing (its parent's
commits are not its own)."""
_KNOWN_LOCK = threading.Lock()


def elsewhere_for(tiers: list[Tier]) -> Elsewhere:
    """This process's :class:`Elsewhere` for the namespace these tiers (as configured) hold."""
    key = tuple(f"{t.name}={t.root}" for t in tiers)
    with _KNOWN_LOCK:
        return _KNOWN.get().setdefault(key, Elsewhere())
