"""Choosing the tier to restore from: the fastest whose committed copy is usable for every rank.

The decision is collective and made once (invariant 5): the coordinator reads the markers and
broadcasts them; each rank checks its share of the files (size, and CRC32C when verifying); the ranks
all-gather their findings and every rank applies the same rule to the same facts, so they never
disagree. Every step runs on every rank even when something fails, so an error on one rank cannot leave
the others waiting in a collective; errors are raised only after the last collective.

A node-local tier's copy is usable only when all of its files sit on the node every rank runs on:
a rank cannot read another node's memory or disk. A **mirrored** memory tier is the exception: there
every rank also probes its own node for markers (its own, and mirrored copies), the ranks take one
inventory of which live node holds which file, own or mirrored (:mod:`tierstore.dcp.mirror.inventory`),
and the copy is usable when every file is held verified on some node; the reader then moves the files a
rank lacks from a node that holds them (:mod:`tierstore.dcp.mirror.peer_read`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tierstore._platform.bounded import Prober
from tierstore.dcp.collectives import all_gather_object, broadcast_object, rank_and_world
from tierstore.dcp.mirror import inventory
from tierstore.errors import CheckpointNotFoundError, TierstoreError
from tierstore.ids import is_newer_commit, marker_path
from tierstore.records.known import elsewhere_for
from tierstore.records.marker import Manifest, copy_problems, parse_marker, read_manifest
from tierstore.records.sightings import Sighting, read_sightings, trusted
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, is_host_memory

logger = logging.getLogger(__name__)
NO_MARKER = "no commit marker"


@dataclass(frozen=True)
class Choice:
    """The tier picked for a restore, and the manifest of its copy."""

    tier_index: int
    manifest: Manifest
    holdings: inventory.Holdings | None = None
    """For a mirrored memory tier: which live node holds which file (own or mirrored)."""
    rank_nodes: list[int] = field(default_factory=list)
    """The node of every rank, in rank order."""


def _check_share(
    tiers: list[Tier],
    manifests: dict[int, Manifest],
    *,
    mirrored: str | None,
    rank: int,
    world: int,
    rank_nodes: list[int],
    verify: bool,
) -> tuple[dict[int, list[str]], dict[int, dict[str, str]]]:
    """This rank's findings: problems per tier, and for mirrored tiers what its node holds."""
    problems: dict[int, list[str]] = {}
    held: dict[int, dict[str, str]] = {}
    for index, manifest in manifests.items():
        tier = tiers[index]
        if tier.name == mirrored:
            share = inventory.node_share(manifest, rank, rank_nodes)
            try:
                held[index] = inventory.held_here(tier, manifest, share, verify=verify)
            except Exception as exc:  # noqa: BLE001 - an unreadable node holds nothing
                problems[index] = [f"node {rank_nodes[rank]} unreadable: {exc}"]
            continue
        holders = set(manifest.nodes)
        if tier.node_local and (len(holders) != 1 or set(rank_nodes) != holders):
            elsewhere = sorted(
                {f.rank for f in manifest.files if f.node not in rank_nodes and f.rank is not None}
            )
            missing = f" (rank(s) {elsewhere} saved on other nodes)" if elsewhere else ""
            if len(holders) > 1:
                why = f"its files are spread over nodes {sorted(holders)}"
            else:
                why = f"its files are on node {min(holders)} but ranks run on node(s)"
                why += f" {sorted(set(rank_nodes))}"
            problems[index] = [
                f"{why}; a node-local copy serves only the ranks of its own node{missing}"
                " (a mirrored memory tier serves every node: docs/mirror.md)"
            ]
            continue
        share = [f for position, f in enumerate(manifest.files) if position % world == rank]
        try:
            problems[index] = copy_problems(tier, manifest, verify=verify, entries=share)
        except Exception as exc:  # noqa: BLE001 - an unreachable tier is one more reason to skip it
            problems[index] = [f"unreachable: {exc}"]
    return problems, held


def _probe_mirrored(
    tiers: list[Tier], checkpoint_id: str, indexes: list[int], mirrored: str | None, trust: MarkerTrust
) -> dict[int, inventory.NodeProbe]:
    """Every rank: what its node holds for each mirrored tier among ``indexes`` (markers, own and
    mirrored; parts)."""
    found: dict[int, inventory.NodeProbe] = {}
    node_local = [t for t in tiers if t.node_local]  # evidence of newer saves: every one of them
    for index in indexes:
        tier = tiers[index]
        if tier.name == mirrored:
            try:
                found[index] = inventory.probe_node(tier, checkpoint_id, trust, node_local)
            except Exception as exc:  # noqa: BLE001 - a node that cannot be read holds nothing
                logger.warning("restore of %s: cannot probe %s: %s", checkpoint_id, tier.name, exc)
    return found


def _newest_marker(
    tier: Tier, blobs: list[bytes], reasons: list[str], probes: list[inventory.NodeProbe], trust: MarkerTrust
) -> tuple[bytes | None, str | None, tuple[int, str] | None]:
    """The newest commit among markers found on any node (own or mirrored copies); none when live
    nodes hold evidence of a newer save of the id (see :func:`inventory.newer_saves`), whose
    ``(seq, generation)`` is returned third: no slower tier's older generation may be served."""
    best: Manifest | None = None
    for blob in set(blobs):
        try:
            manifest = parse_marker(blob, where=f"tier {tier.name}", trust=trust)
        except Exception as exc:  # noqa: BLE001 - one bad copy; others may do
            reasons.append(str(exc))
            continue
        if best is None or is_newer_commit(manifest.seq, manifest.generation, best.seq, best.generation):
            best = manifest
    if best is None:
        return None, "; ".join(reasons) or "no commit marker on any node, own or mirrored", None
    newer = inventory.newer_saves(best, probes)
    if newer:
        return (
            None,
            (
                f"the newest marker held in memory names generation {best.generation} (commit"
                f" {best.seq}), but live nodes hold evidence of a newer save of this id"
                f" ({', '.join(text for _s, _g, text in newer)}) whose marker is not held in memory"
                " by any live node: restoring the older contents under this id could undo that save"
            ),
            newer[-1][:2],
        )
    return best.to_json(), None, None


@dataclass(frozen=True)
class Known:
    """What the coordinator knows of an id's commits without asking the slower tiers."""

    commits: dict[str, tuple[int | None, str]] = field(default_factory=dict)
    """``{tier name: (seq, generation)}`` of the id, from sightings and this process's commits."""
    sighted: frozenset[str] = frozenset()
    """Tiers the promoter has sighted (their commits are known); the others must be asked."""
    evidence: dict[str, tuple[int | None, str]] = field(default_factory=dict)
    """``{tier name: (seq, generation)}`` from sightings too old to trust: a commit of the id that
    tier held. It counts only for a tier that does not answer when asked (see
    :func:`_with_unanswered`): one that answers says what it holds now (an operator's drop)."""
    evidence_below: bool = False
    """The fastest tier holds no sightings (host memory lost with them): the first middle tier
    holding some is read for :attr:`evidence` once a tier does not answer (:func:`_with_unanswered`;
    while every tier answers the evidence counts for none, and reading it would cost a listing of
    an S3 middle tier per restore)."""

    def newest(self) -> tuple[int | None, str, str] | None:
        """``(seq, generation, tier)`` of the newest known commit of the id, or None."""
        return max(
            ((seq, gen, name) for name, (seq, gen) in self.commits.items()),
            key=lambda c: (c[0] is not None, c[0] or 0, c[1]),
            default=None,
        )


def _newest_known(tiers: list[Tier], checkpoint_id: str, prober: Prober, trust: float) -> Known:
    """Coordinator: what is known, without asking the slower tiers, of the id's commit in each of
    them: the promoter's sightings, and this process's own commits.

    The fastest tier's sightings younger than ``trust`` seconds say what each sighted tier holds
    (the tiers a restore need not ask). Older ones are evidence for a tier that does not answer
    (:attr:`Known.evidence`): an older content is not served over a newer commit it saw. When the
    fastest tier holds none (host memory lost with them, a node replaced), the first middle tier
    holding sightings is read for that evidence, once a tier does not answer."""
    commits: dict[str, tuple[int | None, str]] = {}
    sightings = _sightings(tiers[0], checkpoint_id, prober)
    fresh = trusted(sightings, trust)
    evidence: dict[str, tuple[int | None, str]] = {}
    for name, sighting in sightings.items():
        if checkpoint_id in sighting.ids:
            (commits if name in fresh else evidence)[name] = sighting.ids[checkpoint_id]
    own = elsewhere_for(tiers).own_commits(fresh).get(checkpoint_id)
    if own is not None:
        commits[own[0]] = (own[1], own[2])
    return Known(commits, frozenset(fresh), evidence, evidence_below=not sightings)


def _evidence_below(
    tiers: list[Tier], checkpoint_id: str, prober: Prober
) -> dict[str, tuple[int | None, str]]:
    """The id's commits in the sightings of the first middle tier holding any (see
    :attr:`Known.evidence_below`)."""
    for tier in tiers[1:-1]:
        if sightings := _sightings(tier, checkpoint_id, prober):
            return {n: s.ids[checkpoint_id] for n, s in sightings.items() if checkpoint_id in s.ids}
    return {}


def _sightings(tier: Tier, checkpoint_id: str, prober: Prober) -> dict[str, Sighting]:
    """The sightings in ``tier`` (none when they cannot be read: then the tiers are asked)."""
    try:
        found: dict[str, Sighting] = prober.ask(
            tier, lambda: read_sightings(tier), what="read sightings", direct=is_host_memory(tier)
        )
    except Exception as exc:  # noqa: BLE001 - then every tier is asked, as before sightings
        logger.warning("restore of %s: no sightings in %s: %s", checkpoint_id, tier.name, exc)
        return {}
    return found


def _probe_window(
    tiers: list[Tier],
    checkpoint_id: str,
    start: int,
    trust: MarkerTrust,
    *,
    known: Known,
    prober: Prober,
    before: Callable[[int, bool], None],
) -> list[tuple[int, bytes | None, str | None]]:
    """Coordinator: the markers of ``tiers[start:]``, fastest first, until one holds the newest
    commit of the id that is known, sighted or probed: a slower tier is not asked when a faster one
    answers. A tier never sighted is asked too (its commits are not known otherwise), each within
    ``probe_timeout``; an unreachable one is a reason, not an error. ``before(index, False)`` (the read
    record) runs only for the tiers up to the first marker found: those read after it are asked
    only whether they hold a newer commit (see :func:`_announced`)."""
    newest = known.newest()
    best = None if newest is None else (newest[0], newest[1])
    window: list[tuple[int, bytes | None, str | None]] = []
    for index in range(start, len(tiers)):
        tier = tiers[index]
        if all(blob is None for _i, blob, _r in window):
            before(index, False)
        try:
            manifest = prober.ask(
                tier,
                functools.partial(read_manifest, tier, checkpoint_id, trust=trust),
                what=f"read the marker of {checkpoint_id}",
                direct=is_host_memory(tier),
            )
        except FileNotFoundError:
            window.append((index, None, NO_MARKER))
            continue
        except Exception as exc:  # noqa: BLE001 - reported per tier; other tiers may do
            window.append((index, None, str(exc)))
            continue
        window.append((index, manifest.to_json(), None))
        if best is None or not is_newer_commit(best[0], best[1], manifest.seq, manifest.generation):
            best = (manifest.seq, manifest.generation)
        unsighted_below = [t for t in tiers[index + 1 :] if t.name not in known.sighted]
        if manifest.generation == best[1] and not unsighted_below:
            break  # the newest known commit, and nothing below holds one this does not know of
    return window


def _announced(window: list[tuple[int, bytes | None, str | None]]) -> int:
    """How many of the window's tiers were announced in (see :func:`_probe_window`): those up to
    and including the first with a marker. Only their copies may be chosen in this window. A copy
    further down was read without a read record, so retention may be deleting it: it counts as a
    commit of the id (a newer one shadows the faster copy), and it is chosen only in a later window
    that announces the restore there first and reads its marker again."""
    for position, (_index, blob, _reason) in enumerate(window):
        if blob is not None:
            return position + 1
    return len(window)


def _with_unanswered(
    known: Known,
    tiers: list[Tier],
    window: list[tuple[int, bytes | None, str | None]],
    read_below: Callable[[], dict[str, tuple[int | None, str]]],
) -> Known:
    """``known``, with the evidence of the window's tiers that did not answer counted as known
    commits (a tier that answered, with a marker or without, replaces its evidence).
    ``read_below``: the evidence in a middle tier's sightings, read only when one did not answer
    and :attr:`Known.evidence_below` says to."""
    failed = {tiers[i].name for i, blob, reason in window if blob is None and reason != NO_MARKER}
    if failed and known.evidence_below:
        known = dataclasses.replace(known, evidence=read_below(), evidence_below=False)
    taken = {n: c for n, c in known.evidence.items() if n in failed and n not in known.commits}
    if not taken:
        return known
    return dataclasses.replace(known, commits={**known.commits, **taken})


def _with_window(
    known: Known, tiers: list[Tier], window: list[tuple[int, bytes | None, str | None]], trust: MarkerTrust
) -> Known:
    """``known`` and the commits whose markers a window read (usable or not)."""
    commits = dict(known.commits)
    for index, blob, _reason in window:
        if blob is None:
            continue
        try:
            manifest = parse_marker(blob, where=f"tier {tiers[index].name}", trust=trust)
        except Exception as exc:  # noqa: BLE001 - a marker that does not parse says nothing
            logger.debug("ignoring the marker of tier %s: %s", tiers[index].name, exc)
            continue
        commits[tiers[index].name] = (manifest.seq, manifest.generation)
    return dataclasses.replace(known, commits=commits)


def _keep_only_the_newest_commit(
    tiers: list[Tier],
    manifests: dict[int, Manifest],
    reasons: dict[int, list[str]],
    known: Known | None = None,
) -> None:
    """Drop the copies of an older generation than the newest committed in any tier.

    An overwrite may commit in a lower tier (``tier=``) while a faster one still holds the previous
    generation: restoring the faster copy would serve stale data. Never: only the newest counts,
    whether its marker was read here or the promoter saw it (``known``, sightings).
    """
    commits = [(m.seq, m.generation, tiers[i].name) for i, m in manifests.items()]
    commits += [(seq, gen, name) for name, (seq, gen) in (known or Known()).commits.items()]
    if not commits:
        return
    newest = max(commits, key=lambda c: (c[0] is not None, c[0] or 0, c[1]))
    for index in list(manifests):
        manifest = manifests[index]
        if manifest.generation != newest[1] and not is_newer_commit(
            manifest.seq, manifest.generation, newest[0], newest[1]
        ):
            del manifests[index]
            reasons[index] = [
                f"its marker {marker_path(manifest.checkpoint_id)} names generation"
                f" {manifest.generation} (seq {manifest.seq}), older than {newest[1]}"
                f" (seq {newest[0]}) committed in tier {newest[2]}"
            ]


def choose_copy(
    tiers: list[Tier],
    checkpoint_id: str,
    *,
    trust: MarkerTrust,
    mirrored: str | None,
    node: int,
    verify: bool,
    group: dist.ProcessGroup | None = None,
    excluded: dict[int, str] | None = None,
    collective: bool = True,
    prober: Prober | None = None,
    before_probe: Callable[[int, bool], None] = lambda _index, _read: None,
    sighting_trust: float = 30.0,
) -> Choice:
    """Pick the fastest tier holding a usable committed copy; the same answer on every rank.

    Tiers are looked at fastest first, in windows: the coordinator reads markers until one holds
    the newest known commit of the id (see :func:`_probe_window`), every rank checks its share of
    the window's copies, and only if none is usable is the next window looked at. So a restore
    served by host memory asks nothing of S3. ``trust`` reads the markers; ``mirrored`` names the
    mirrored tier (:attr:`~tierstore.config.Config.mirrored`). ``before_probe(index, read)`` runs on
    every rank before a copy in ``tiers[index]`` may be chosen (the reader announces its read there;
    ``read``: the coordinator read a marker there, so the rank announces it even where its own view
    skips the tier; a slower tier asked only whether it holds a newer commit is not announced in:
    :func:`_announced`). ``excluded`` maps tier indexes already found unusable (and why) to skip;
    ``prober`` bounds each marker read (default: 10 s); a sighting older than ``sighting_trust``
    seconds is not trusted (the promoter is not running). With ``collective=False`` this process
    decides alone, as a job of one rank would. Raises :class:`CheckpointNotFoundError` listing
    every tier looked at and why it was skipped.
    """
    rank, world = rank_and_world(group) if collective else (0, 1)
    prober = prober or Prober(10.0)
    reasons: dict[int, list[str]] = {}
    known = Known()
    if rank == 0:
        known = _newest_known(tiers, checkpoint_id, prober, sighting_trust)
    start = 0
    while start < len(tiers):
        window = (
            _probe_window(tiers, checkpoint_id, start, trust, known=known, prober=prober, before=before_probe)
            if rank == 0
            else []
        )
        if rank == 0:
            below = functools.partial(_evidence_below, tiers, checkpoint_id, prober)
            known = _with_unanswered(known, tiers, window, below)
        window, known = broadcast_object((window, known), group) if collective else (window, known)
        head, rest = window[: _announced(window)], window[_announced(window) :]
        if rank != 0:
            for index, blob, _reason in head:
                before_probe(index, blob is not None)
        choice, known = _choose_in_window(
            tiers,
            checkpoint_id,
            head,
            _with_window(known, tiers, rest, trust),
            reasons,
            trust=trust,
            mirrored=mirrored,
            node=node,
            verify=verify,
            group=group,
            excluded=excluded or {},
            collective=collective,
            rank=rank,
            world=world,
        )
        if choice is not None:
            return choice
        # A later window's copies count only if they hold the newest commit the earlier windows
        # showed (their unusable copies included: a newer commit spread over nodes, say).
        known = _with_window(known, tiers, head, trust)
        start = rest[0][0] if rest else window[-1][0] + 1 if window else len(tiers)
    lines = [f"  {t.describe()}: {'; '.join(reasons.get(i, ['?']))}" for i, t in enumerate(tiers)]
    lines.append(
        f"`tierstore verify {checkpoint_id}` checks every copy; `tierstore ls` lists the"
        " checkpoints that can be restored instead"
    )
    raise CheckpointNotFoundError(
        f"no tier holds a usable committed copy of checkpoint {checkpoint_id!r}:\n" + "\n".join(lines)
    )


def _choose_in_window(
    tiers: list[Tier],
    checkpoint_id: str,
    window: list[tuple[int, bytes | None, str | None]],
    known: Known,
    reasons: dict[int, list[str]],
    *,
    trust: MarkerTrust,
    mirrored: str | None,
    node: int,
    verify: bool,
    group: dist.ProcessGroup | None,
    excluded: dict[int, str],
    collective: bool,
    rank: int,
    world: int,
) -> tuple[Choice | None, Known]:
    """The first usable copy among the window's tiers, decided on every rank alike; else None (the
    window's reasons are added to ``reasons``). Returned with ``known`` and the evidence of newer
    commits the window's mirrored tiers showed (the same on every rank)."""
    indexes = [index for index, _blob, _reason in window]
    found: dict[int, tuple[bytes | None, str | None]] = {i: (b, r) for i, b, r in window}
    mine = (node, _probe_mirrored(tiers, checkpoint_id, indexes, mirrored, trust))
    everyone = all_gather_object(mine, group) if collective else [mine]
    rank_nodes = [n for n, _ in everyone]
    for index in indexes:
        if tiers[index].name == mirrored:
            blob, reason = found[index]
            blobs = [blob] if blob is not None else []
            probes = [p[index] for _, p in everyone if index in p]
            blobs += [b for probe in probes for b in probe.markers]
            other = [] if reason in (None, NO_MARKER) else [f"node of rank 0: {reason}"]
            blob, reason, evidence = _newest_marker(tiers[index], blobs, other, probes, trust)
            found[index] = (blob, reason)
            if evidence is not None:  # a newer commit than any marker held: it decides "newest"
                commits = {**known.commits, tiers[index].name: evidence}
                known = dataclasses.replace(known, commits=commits)
    manifests: dict[int, Manifest] = {}
    for index, (blob, reason) in found.items():
        if blob is None:
            reasons[index] = [reason or NO_MARKER]
        else:
            manifests[index] = parse_marker(blob, where=f"tier {tiers[index].name}", trust=trust)
    _keep_only_the_newest_commit(tiers, manifests, reasons, known)
    for index, reason in excluded.items():
        if index in manifests or index in found:
            manifests.pop(index, None)
            reasons[index] = [reason]
    local: tuple[dict[int, list[str]], dict[int, dict[str, str]]] | Exception
    try:
        local = _check_share(
            tiers, manifests, mirrored=mirrored, rank=rank, world=world, rank_nodes=rank_nodes, verify=verify
        )
    except Exception as exc:  # noqa: BLE001 - carried to every rank, raised after the collective
        local = exc
    gathered: list[Any] = all_gather_object(local, group) if collective else [local]
    for item in gathered:
        if isinstance(item, Exception):
            raise TierstoreError(f"checking checkpoint {checkpoint_id!r} failed: {item}") from item
    findings: list[dict[int, list[str]]] = [problems for problems, _ in gathered]
    holdings: dict[int, inventory.Holdings] = {}
    for index, manifest in manifests.items():
        if tiers[index].name == mirrored:
            holdings[index] = inventory.by_node([h.get(index, {}) for _, h in gathered], rank_nodes)
            findings.append({index: inventory.unheld(manifest, holdings[index])})
    for index, manifest in manifests.items():
        issues = [p for item in findings for p in item.get(index, [])]
        if issues:  # the marker first: it is what names these files (or what is wrong itself)
            reasons[index] = [
                f"its marker {marker_path(checkpoint_id)} names generation {manifest.generation},"
                " whose files are not usable",
                *sorted(set(issues)),
            ]
    for index in indexes:
        if index in manifests and index not in reasons:
            if rank == 0:
                for skipped in range(index):
                    # An excluded tier is the caller's decision, which it reported (or was asked
                    # for: `restore --tier`): warning of it again would be noise.
                    if skipped in reasons and skipped not in excluded:
                        logger.warning(
                            "restore of %s: skipping tier %s: %s",
                            checkpoint_id,
                            tiers[skipped].name,
                            "; ".join(reasons[skipped]),
                        )
            return Choice(index, manifests[index], holdings.get(index), rank_nodes), known
    return None, known
