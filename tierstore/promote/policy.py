"""Promotion and retention rules: pure functions of what each tier holds, no I/O.

Which checkpoint reaches which tier (``seq % every_j == 0``, copied from the tier right above or the
nearest above holding it) and what retention keeps in each tier (``keep``, ``keep_every``, ``pin``, and
what a tier never deletes) are docs/operations.md, "Promotion" and "Retention". Deletion removes the
marker first, then the data (see :mod:`tierstore.records.protocol`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tierstore.ids import is_newer_commit, newest_first


@dataclass(frozen=True)
class TierRules:
    """One tier's rules: its YAML ``keep``, ``keep_every``, ``pin`` and ``every``."""

    name: str
    node_local: bool = False
    """Each node has its own copy of the tier (a durable copy is one in a job-wide tier)."""
    keep: int | None = None
    keep_every: int | None = None
    pin: tuple[str, ...] = ()
    every: int | None = None


@dataclass(frozen=True)
class Rules:
    """Everything the policy decides by: the tiers' rules, fastest first, and the promoter's
    (built from a configuration by :func:`tierstore.promote.rules.rules_of`)."""

    tiers: tuple[TierRules, ...]
    durable_every: int = 1
    """``promote.every``: the last (durable) tier's frequency unless it sets its own ``every``."""
    stale_after: float = 3600.0
    """``promote.stale_after``: how long a node's part of an unseen commit waits for promotion."""


@dataclass(frozen=True)
class Copy:
    """A committed copy of a checkpoint in one tier (as the catalog sees it)."""

    checkpoint_id: str
    seq: int | None
    step: int | None
    committed_at: float
    generation: str
    partial: bool = False
    """Only this node's part, seen through part records: the commit itself is not visible here."""
    confirmed: bool = False
    """Of a partial copy: its save is known to have committed under its number (the coordinator
    confirmed it): it is held for promotion like any commit, however old."""
    conflicts: frozenset[str] = frozenset()
    """Tiers below holding another content of this id that promotion must not replace (nor be
    replaced by): the copy is kept here and not promoted there (:mod:`tierstore.records.conflicts`)."""
    source: str = ""
    """The tier this copy was promoted from ('' for a save's own commit): its commit was made
    there first, so that tier's marker of the id has named this generation."""
    overwrite: bool | None = None
    """The marker's ``overwrite``: its save replaced what it knew of the id (None: a marker from
    before it was recorded, judged by commit order)."""
    unseen_tiers: frozenset[str] = frozenset()
    """Tiers its save could not see when its job started (its number says nothing of theirs)."""


Holdings = Mapping[str, Mapping[str, Copy]]
"""What each tier holds: ``{tier name: {checkpoint id: Copy}}``."""


@dataclass(frozen=True)
class Promotion:
    """Copy ``checkpoint_id`` from tier ``source`` to tier ``target``."""

    checkpoint_id: str
    source: str
    target: str


@dataclass(frozen=True)
class Deletion:
    """Delete ``checkpoint_id`` (its copy of ``generation``) from ``tier``, and why."""

    tier: str
    checkpoint_id: str
    reason: str
    generation: str = ""


def every_for(rules: Rules, index: int) -> int:
    """The promotion frequency of tier ``index`` (see the module docstring)."""
    tier = rules.tiers[index]
    if tier.every is not None:
        return tier.every
    return rules.durable_every if index == len(rules.tiers) - 1 else 1


def is_selected(copy: Copy, every: int) -> bool:
    """True when a checkpoint with this ``seq`` belongs in a tier promoting ``every`` k-th one."""
    if every == 1:
        return True
    return copy.seq is not None and copy.seq % every == 0


def is_newer(copy: Copy, other: Copy) -> bool:
    """True when ``copy`` is a newer commit than ``other`` (see :func:`tierstore.ids.is_newer_commit`)."""
    return is_newer_commit(copy.seq, copy.generation, other.seq, other.generation)


def _newest_per_id(copies: Iterable[Copy]) -> dict[str, Copy]:
    """One copy per id: its newest generation among ``copies``."""
    by_id: dict[str, Copy] = {}
    for copy in copies:
        known = by_id.get(copy.checkpoint_id)
        if known is None or is_newer(copy, known):
            by_id[copy.checkpoint_id] = copy
    return by_id


def _numbered(copy: Copy) -> bool:
    """True when the copy's number is its commit's: not a node's unconfirmed part (its number is
    the one planned; the coordinator may take another at its commit)."""
    return not (copy.partial and not copy.confirmed)


def _replaced(copy: Copy, where: str, newer: Copy) -> bool:
    """True when ``newer`` replaced ``copy`` (held in tier ``where``): a newer commit whose save
    could see that tier and meant to replace the id, neither side in a recorded conflict. The
    terms of :func:`tierstore.records.protocol.judge_promotion`'s ``REPLACE``; otherwise the two
    are contents in conflict, both kept."""
    return (
        is_newer(newer, copy)
        and not copy.conflicts
        and not newer.conflicts
        and newer.overwrite is not False
        and where not in newer.unseen_tiers
    )


def _overtaken(copy: Copy, tiers: list[str], newest: Mapping[str, Copy]) -> bool:
    """True when the newest known commit of the id (``newest``: per id) replaced ``copy``, held in
    ``tiers``. A node's unconfirmed part is not judged (its number is the one planned)."""
    known = newest.get(copy.checkpoint_id)
    return _numbered(copy) and known is not None and all(_replaced(copy, t, known) for t in tiers)


def _ordered(copies: Iterable[Copy]) -> list[Copy]:
    """The newest generation of each id, newest commit first (commit order, never names)."""
    by_id = _newest_per_id(copies)
    return [by_id[i] for i in newest_first((c.checkpoint_id, c.seq) for c in by_id.values())]


def kept_by_rules(tier: TierRules, copies: Iterable[Copy]) -> dict[str, str]:
    """``{id: why it is kept}`` under the tier's own keep/keep_every/pin rules (newest always)."""
    ordered = _ordered(copies)
    kept: dict[str, str] = {}
    for position, copy in enumerate(ordered):
        if position == 0:
            kept[copy.checkpoint_id] = "newest in tier"
        elif tier.keep is None:
            kept[copy.checkpoint_id] = "no keep limit"
        elif position < tier.keep:
            kept[copy.checkpoint_id] = f"among the {tier.keep} newest"
        elif copy.checkpoint_id in tier.pin:
            kept[copy.checkpoint_id] = "pinned"
        elif tier.keep_every and copy.step is not None and copy.step % tier.keep_every == 0:
            kept[copy.checkpoint_id] = f"milestone (step multiple of {tier.keep_every})"
    return kept


def routed_around(rules: Rules, unavailable: frozenset[str]) -> frozenset[str]:
    """The refusing or unreachable tiers that promotion routes around: every one but the last
    (durable) tier.

    Skipping a full or failed middle tier costs it copies. The durable tier is not skipped: the tiers
    above keep the newest checkpoint it lacks (see :func:`retention`) until it returns, and it is
    retried every pass.
    """
    return unavailable - {rules.tiers[-1].name}


def promotions(rules: Rules, held: Holdings, unavailable: frozenset[str] = frozenset()) -> list[Promotion]:
    """Every copy to make now, newest checkpoints first (they shorten the recovery-point lag most).

    ``unavailable`` names tiers that refuse writes: copies into them are still planned (they are
    retried every pass), but the tiers below no longer wait for them; they copy from the nearest
    tier above that holds the checkpoint.
    """
    names = [t.name for t in rules.tiers]
    skipped = routed_around(rules, unavailable)
    planned: list[Promotion] = []
    missing = _missing_everywhere(rules, held)
    for index in range(1, len(names)):
        arriving_above = {
            (c.checkpoint_id, c.generation) for c in missing[index - 1] if names[index - 1] not in skipped
        }
        for copy in missing[index]:
            if (copy.checkpoint_id, copy.generation) in arriving_above:
                continue  # it reaches this tier from the one right above, once it is there
            sources = [  # only a tier holding this very generation may be copied from
                n
                for n in names[:index]
                if (held_there := held.get(n, {}).get(copy.checkpoint_id)) is not None
                and held_there.generation == copy.generation
            ]
            healthy = [n for n in sources if n not in unavailable] or sources
            planned.append(Promotion(copy.checkpoint_id, healthy[-1], names[index]))
    return planned


def _missing_everywhere(rules: Rules, held: Holdings) -> list[list[Copy]]:
    """:func:`_missing_in` of every tier, by index (the first tier has nothing above it), with the
    newest commit of each id worked out once for all of them: a pass over 10,000 retained
    checkpoints in 4 tiers otherwise walks every copy a dozen times."""
    names = [t.name for t in rules.tiers]
    newest = _newest_per_id(c for n in names for c in held.get(n, {}).values() if _numbered(c))
    return [[], *(_missing_in(rules, held, i, newest) for i in range(1, len(names)))]


def _missing_in(rules: Rules, held: Holdings, index: int, newest: Mapping[str, Copy]) -> list[Copy]:
    """Copies held above tier ``index`` that belong in it but are not there yet (newest first).

    A copy is identified by id **and generation**: an id held here at an older generation (it was
    overwritten above) is missing its newer one, which must replace it whatever ``every`` says, or
    this tier would serve stale data once the tiers above let go. Otherwise a checkpoint belongs in
    a tier when it is selected by the tier's ``every`` and the tier's retention would keep it:
    nothing is promoted only to be deleted at once. A copy of an id with a newer commit in any
    tier that replaced it (an overwrite saved straight into a lower tier) is not promoted: a
    restore would refuse it, and in a tier between it could be served once the tiers that know
    better are away. A content in conflict with a higher-numbered one still is (both are kept).
    ``newest``: the newest numbered copy of each id in any tier.
    """
    names = [t.name for t in rules.tiers]
    here = held.get(names[index], {})
    every = every_for(rules, index)
    above = [c for n in names[:index] for c in held.get(n, {}).values()]
    conflicted = {(c.checkpoint_id, c.generation) for c in above if names[index] in c.conflicts}

    def holders(copy: Copy) -> list[str]:
        return [n for n in names[:index] if held.get(n, {}).get(copy.checkpoint_id) == copy]

    candidates = [
        c
        for c in _ordered(above)
        if (c.checkpoint_id, c.generation) not in conflicted
        and not _overtaken(c, holders(c), newest)
        and (
            (c.checkpoint_id not in here and is_selected(c, every))
            or (c.checkpoint_id in here and is_newer(c, here[c.checkpoint_id]))
        )
    ]
    kept = kept_by_rules(rules.tiers[index], [*here.values(), *candidates])
    return [c for c in candidates if c.checkpoint_id in kept]


def retention(
    rules: Rules,
    held: Holdings,
    in_use: frozenset[str] = frozenset(),
    *,
    now: float | None = None,
    unavailable: frozenset[str] = frozenset(),
) -> list[Deletion]:
    """Every copy that retention deletes now, with the rule that made the decision.

    A copy still missing below is kept for it, except in a middle tier that refuses writes
    (``unavailable``, see :func:`routed_around`): the tiers above must not fill up waiting for it.

    A node's part of a save whose commit it cannot see (``partial``) waits for promotion only for
    ``promote.stale_after``: a save that failed on another node never commits, and must not hold
    memory forever. A part whose save is confirmed committed waits like any commit: released
    unpromoted, it would leave the coordinator's marker over missing files.
    """
    now = time.time() if now is None else now
    stale = rules.stale_after
    names = [t.name for t in rules.tiers]
    kept = {n: kept_by_rules(rules.tiers[i], held.get(n, {}).values()) for i, n in enumerate(names)}
    skipped = routed_around(rules, unavailable)
    pending: set[tuple[str, str]] = set()
    everywhere = _missing_everywhere(rules, held)
    for j in range(1, len(names)):
        if names[j] in skipped:
            continue
        missing = [
            c for c in everywhere[j] if not (c.partial and not c.confirmed and now - c.committed_at >= stale)
        ]
        if names[j] in unavailable:
            # The durable tier is away: the tiers above hold only the newest checkpoint it lacks
            # beyond their own rules, so that saves keep committing while it is gone.
            missing = missing[:1]
        pending |= {(n, c.checkpoint_id) for c in missing for n in names[:j]}
    durable = [t.name for t in rules.tiers if not t.node_local]
    known = {n: c for n, c in held.items() if n in names}
    deletions = [d for d in overtaken(names, known) if d.checkpoint_id not in in_use]
    judged = {(d.tier, d.checkpoint_id) for d in deletions}  # each (tier, id) is visited once below
    for name in names:
        for checkpoint_id in held.get(name, {}):
            if (
                checkpoint_id in kept[name]
                or checkpoint_id in in_use
                or (name, checkpoint_id) in judged
                or (name, checkpoint_id) in pending
                or held[name][checkpoint_id].conflicts  # both contents kept until settled
            ):
                continue
            kept_elsewhere = any(checkpoint_id in kept[n] for n in names if n != name)
            other_durable = [n for n in durable if n != name and checkpoint_id in kept[n]]
            if name in durable and kept_elsewhere and not other_durable:
                continue  # the last durable copy of a checkpoint some tier keeps
            deletions.append(
                Deletion(
                    name,
                    checkpoint_id,
                    _why_deleted(rules.tiers[names.index(name)]),
                    held[name][checkpoint_id].generation,
                )
            )
    return deletions


def overtaken(names: list[str], held: Holdings) -> list[Deletion]:
    """Copies that a newer commit of their id in a slower tier replaced (an overwrite saved
    straight there) that could see them: the terms of
    :func:`tierstore.records.protocol.judge_promotion`'s ``REPLACE``. ``names``: fastest first.

    A restore refuses such a copy while it knows of the newer commit; kept, it could be served
    once the tier holding that commit is away and what knew of it is lost (host memory, with the
    sightings). Never judged: a node's part (its number may be the one planned), a copy in a
    recorded conflict, nor one the newer save could not see or did not mean to replace. A copy
    in a tier below the newer commit's waits for that commit's promotion to replace it: until
    then it is the durable one. A content is judged in every tier holding it: one side of a
    conflict promoted into a middle tier after the newer save (no conflict recorded there) is the
    same content that save could not see, not one it replaced.
    """
    newest: dict[str, tuple[str, Copy]] = {}
    holders: dict[tuple[str, str], list[tuple[str, Copy]]] = {}
    for name, copies in held.items():
        for copy in copies.values():
            known = newest.get(copy.checkpoint_id)
            if not copy.partial and (known is None or is_newer(copy, known[1])):
                newest[copy.checkpoint_id] = (name, copy)
            if not copy.partial:  # a node's part is not judged (its number may be the planned one)
                holders.setdefault((copy.checkpoint_id, copy.generation), []).append((name, copy))
    deletions: list[Deletion] = []
    for name, copies in held.items():
        for checkpoint_id, copy in copies.items():
            if checkpoint_id not in newest:
                continue
            where, newer = newest[checkpoint_id]
            if (
                names.index(name) >= names.index(where)
                or copy.partial
                or not all(_replaced(c, n, newer) for n, c in holders[(checkpoint_id, copy.generation)])
            ):
                continue
            why = (
                f"overtaken: tier {where} holds a newer commit of the id ({newer.generation},"
                f" seq {newer.seq}) that replaced it"
            )
            deletions.append(Deletion(name, checkpoint_id, why, copy.generation))
    return deletions


def superseded_parts(
    tier: str, parts: Mapping[str, Mapping[str, tuple[int | None, bool]]], held: Holdings
) -> list[Deletion]:
    """The parts a node holds in ``tier`` of saves another node coordinated that a newer commit of
    their id replaced in ``tier`` itself: a copy this node sees elsewhere (``held``) that was
    promoted *from* ``tier`` (its marker there named that newer generation, and markers only move
    forward, so the coordinator's marker no longer names the part's).

    ``parts``: ``{id: {generation: (seq, settled)}}``; only a settled part (its number confirmed
    final) is judged: a planned number says nothing, the save may have committed later under a
    higher one. Without this a node other than the coordinator's keeps every replaced generation
    forever: the marker swap and the drop of the replaced generation happen on the coordinator's
    node only (the coordinator also tells the other nodes at its next save:
    :func:`tierstore.records.protocol.settle_parts`). An id with copies in conflict stays as it is.
    """
    passed: dict[str, Copy] = {}
    conflicted: set[str] = set()
    for copies in held.values():
        for copy in copies.values():
            if copy.conflicts:
                conflicted.add(copy.checkpoint_id)
            known = passed.get(copy.checkpoint_id)
            if copy.source == tier and not copy.partial and (known is None or is_newer(copy, known)):
                passed[copy.checkpoint_id] = copy
    deletions: list[Deletion] = []
    for checkpoint_id, generations in sorted(parts.items()):
        newest = passed.get(checkpoint_id)
        if newest is None or newest.seq is None or checkpoint_id in conflicted:
            continue
        for generation, (seq, settled) in sorted(generations.items()):
            if settled and generation != newest.generation and seq is not None and seq < newest.seq:
                why = f"a part of a save replaced in {tier} by commit {newest.seq} ({newest.generation})"
                deletions.append(Deletion(tier, checkpoint_id, why, generation))
    return deletions


def _why_deleted(tier: TierRules) -> str:
    rules = [f"keep: {tier.keep}"]
    if tier.keep_every:
        rules.append(f"keep_every: {tier.keep_every}")
    if tier.pin:
        rules.append("not pinned")
    return "beyond " + ", ".join(rules)
