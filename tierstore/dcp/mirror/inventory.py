"""What each node holds of a checkpoint in a mirrored memory tier: its own files and its mirrors.

Restore finds shards by the *saved rank* (by file), never by node number: node indices change across a
restart (torchrun re-assigns them; a spare node joins). Each rank checks a share of its node's files,
the ranks all-gather the findings (see :mod:`tierstore.dcp.restore.choice`), and every rank then knows
which live node holds which file, own or mirrored, verified. Mirror copies are always checked against
their CRC32C (a copy that was never read since it arrived is trusted no further than that); own copies
are checked by size, and by CRC32C when the restore verifies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file, marker_path, mirror_copy_path
from tierstore.placement import place
from tierstore.records.marker import FileEntry, Manifest, entry_problem, file_digests, read_manifest
from tierstore.records.mirror import held_mirrors, mirrored_commits
from tierstore.records.parts import part_records
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.topology import current_host

OWN = "own"
MIRROR = "mirror"
Holdings = dict[int, dict[str, str]]
"""Node -> {file path as the marker names it: ``own`` or ``mirror``}."""


@dataclass(frozen=True)
class PartSeen:
    """A save of the id that this node's ranks wrote their part of, in one node-local tier."""

    tier: str
    generation: str
    seq: int
    coordinator_host: str
    """The host of the save's coordinator, whose node alone holds its marker ("" in old records)."""
    confirmed: bool = False
    """``seq`` is the commit's final number; otherwise the planned one, which it may exceed."""


@dataclass(frozen=True)
class NodeProbe:
    """What one node holds of a checkpoint id before any file is checked."""

    markers: list[bytes]
    """Every commit marker of the id in the mirrored tier on the node: its own, and mirrored copies."""
    parts: list[PartSeen] = field(default_factory=list)
    """Each save of the id whose files this node's ranks wrote (their part records), in every
    node-local tier: evidence of a save whose marker may have been lost with another node."""
    own: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    """``{tier: (generation, seq)}`` of the id's own marker in each node-local tier of the node."""
    host: str = ""


def probe_node(
    tier: Tier, checkpoint_id: str, trust: MarkerTrust, node_local: Iterable[Tier] = ()
) -> NodeProbe:
    """See :class:`NodeProbe`; ``node_local``: the node's node-local tiers to gather evidence from
    (the mirrored ``tier`` is always one); their markers read with ``trust``."""
    found: list[bytes] = []
    with contextlib.suppress(FileNotFoundError):
        found.append(tier.read_bytes(marker_path(checkpoint_id)))
    probe = NodeProbe(found + mirrored_commits(tier, checkpoint_id), host=current_host())
    for local in {t.name: t for t in [tier, *node_local]}.values():
        _gather_evidence(local, checkpoint_id, probe, trust)
    return probe


def _gather_evidence(tier: Tier, checkpoint_id: str, probe: NodeProbe, trust: MarkerTrust) -> None:
    with contextlib.suppress(FileNotFoundError, IntegrityError):  # a bad marker proves nothing
        marker = read_manifest(tier, checkpoint_id, trust=trust)
        probe.own[tier.name] = (marker.generation, marker.seq)
    for generation, records in part_records(tier, checkpoint_id).items():
        if records and records[0].seq is not None:
            host, confirmed = records[0].coordinator_host, all(r.confirmed for r in records)
            probe.parts.append(PartSeen(tier.name, generation, records[0].seq, host, confirmed))


def newer_saves(manifest: Manifest, probes: Iterable[NodeProbe]) -> list[tuple[int, str, str]]:
    """Saves of the same id newer than ``manifest`` that live nodes hold evidence of: an own marker
    in any node-local tier, or a part some node's ranks wrote that the live coordinator's node does
    not deny. Their marker may have been lost with another node, so the memory copies may be stale.
    Each is ``(commit number, generation, description)``, lowest number first.

    Which node's evidence counts: in a node-local tier, only the save's coordinator's node holds
    its marker. When that node is live (its host probed) and its marker of the id in that tier names
    another generation, the part's save is not the current commit there (markers only move
    forward): it never committed, or a newer one replaced it. Otherwise (the coordinator's node
    gone or wiped, or a record from before hosts were recorded) the part counts when its number is
    higher. A multi-node save that commits last takes a higher number than it planned; its mirror
    exchange tells every rank the committed marker, and each node confirms its part with the final
    number there (:mod:`tierstore.dcp.mirror.rounds`), so a part still holding its planned number
    is one whose commit no rank of its job learnt (it crashed, or its exchange broke).
    """
    if manifest.seq is None:
        return []
    probes = list(probes)
    owns = {(p.host, name): own for p in probes for name, own in p.own.items()}
    newer: set[tuple[int, str, str]] = set()
    for probe in probes:
        for name, (gen, seq) in probe.own.items():
            if gen != manifest.generation and seq is not None and seq > manifest.seq:
                newer.add((seq, gen, f"generation {gen} (commit {seq}, committed in tier {name})"))
        for part in probe.parts:
            if part.generation == manifest.generation or part.seq <= manifest.seq:
                continue
            said = owns.get((part.coordinator_host, part.tier)) if part.coordinator_host else None
            if said is not None and said[0] != part.generation:
                continue  # the live coordinator's marker names another generation
            number = f"commit {part.seq}" if part.confirmed else f"planned as commit {part.seq}"
            text = f"generation {part.generation} ({number}, parts in tier {part.tier})"
            newer.add((part.seq, part.generation, text))
    return sorted(newer)


def stored_path(checkpoint_id: str, rel: str, kind: str) -> str:
    """Tier-relative path of a file held as ``kind`` (own or mirror)."""
    return checkpoint_file(checkpoint_id, rel) if kind == OWN else mirror_copy_path(checkpoint_id, rel)


def _matches(tier: Tier, path: str, entry: FileEntry, *, verify: bool) -> bool:
    try:
        size = tier.stat(path).size
    except FileNotFoundError:
        return False
    if entry_problem(path, entry, size) is not None:
        return False
    if not verify:
        return True
    digests = file_digests(tier, path, sha256=entry.sha256 is not None)
    return entry_problem(path, entry, *digests) is None


def node_share(manifest: Manifest, rank: int, rank_nodes: list[int]) -> list[FileEntry]:
    """The files this rank checks for its node (the node's ranks split the work)."""
    mates = [r for r, node in enumerate(rank_nodes) if node == rank_nodes[rank]]
    index = mates.index(rank)
    return [f for position, f in enumerate(manifest.files) if position % len(mates) == index]


def held_here(
    tier: Tier, manifest: Manifest, entries: Iterable[FileEntry], *, verify: bool
) -> dict[str, str]:
    """Which of ``entries`` this node holds, verified: ``{path: own | mirror}``."""
    ckpt = manifest.checkpoint_id
    mirrored = {
        (f.path, f.size, f.crc32c)
        for m in held_mirrors(tier, ckpt)
        if m.generation == manifest.generation
        for f in m.files
    }
    held: dict[str, str] = {}
    for entry in entries:
        if _matches(tier, checkpoint_file(ckpt, entry.path), entry, verify=verify):
            held[entry.path] = OWN
        elif (entry.path, entry.size, entry.crc32c) in mirrored and _matches(
            tier, mirror_copy_path(ckpt, entry.path), entry, verify=True
        ):
            held[entry.path] = MIRROR
    return held


def by_node(findings: list[dict[str, str]], rank_nodes: list[int]) -> Holdings:
    """Merge every rank's findings into what each live node holds."""
    merged: Holdings = {}
    for rank, held in enumerate(findings):
        merged.setdefault(rank_nodes[rank], {}).update(held)
    return merged


def expected_holders(manifest: Manifest) -> dict[int, int]:
    """Owner node -> the node that should hold its mirror, recomputed from the topology the commit
    marker records (empty for a copy saved without mirroring)."""
    topology = manifest.topology or {}
    hosts = {int(node): str(host) for node, host in dict(topology.get("hosts") or {}).items()}
    if not hosts:
        return {}
    return dict(place(hosts, stride=int(topology.get("mirror_stride", 1))).holder_of)


def unheld(manifest: Manifest, holdings: Holdings) -> list[str]:
    """One line per file that no live node holds verified (empty: peer-restorable)."""
    lines = []
    holders = expected_holders(manifest)
    for entry in manifest.files:
        if not any(entry.path in held for held in holdings.values()):
            who = "the coordinator" if entry.rank is None else f"rank {entry.rank}"
            mirror = holders.get(entry.node)
            where = f"; its mirror belongs on saving node {mirror}" if mirror is not None else ""
            lines.append(
                f"{checkpoint_file(manifest.checkpoint_id, entry.path)} (saved by {who} on node"
                f" {entry.node}{where}): no verified copy, own or mirrored, in the memory of any"
                " node of this job"
            )
    return lines
