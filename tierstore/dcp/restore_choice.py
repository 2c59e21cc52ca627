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

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tierstore.dcp.collectives import all_gather_object, broadcast_object, rank_and_world
from tierstore.dcp.mirror import inventory
from tierstore.errors import CheckpointNotFoundError, TierstoreError
from tierstore.ids import is_newer_commit
from tierstore.records.marker import Manifest, copy_problems, read_manifest
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """The tier picked for a restore, and the manifest of its copy."""

    tier_index: int
    manifest: Manifest
    holdings: inventory.Holdings | None = None
    """For a mirrored memory tier: which live node holds which file (own or mirrored)."""
    rank_nodes: list[int] = field(default_factory=list)
    """The node of every rank, in rank order."""


def _probe_markers(tiers: list[Tier], checkpoint_id: str) -> list[tuple[bytes | None, str | None]]:
    """Coordinator: each tier's marker bytes (validated), or why there is none."""
    found: list[tuple[bytes | None, str | None]] = []
    for tier in tiers:
        try:
            found.append((read_manifest(tier, checkpoint_id).to_json(), None))
        except FileNotFoundError:
            found.append((None, "no commit marker"))
        except Exception as exc:  # noqa: BLE001 - reported per tier; other tiers may do
            found.append((None, str(exc)))
    return found


def _check_share(
    tiers: list[Tier],
    manifests: dict[int, Manifest],
    *,
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
        if tier.mirror is not None:
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


def _probe_mirrored(tiers: list[Tier], checkpoint_id: str) -> dict[int, inventory.NodeProbe]:
    """Every rank: what its node holds for each mirrored tier (markers, own and mirrored; parts)."""
    found: dict[int, inventory.NodeProbe] = {}
    for index, tier in enumerate(tiers):
        if tier.mirror is not None:
            try:
                found[index] = inventory.probe_node(tier, checkpoint_id)
            except Exception as exc:  # noqa: BLE001 - a node that cannot be read holds nothing
                logger.warning("restore of %s: cannot probe %s: %s", checkpoint_id, tier.name, exc)
    return found


def _newest_marker(
    tier: Tier, blobs: list[bytes], reasons: list[str], probes: list[inventory.NodeProbe]
) -> tuple[bytes | None, str | None]:
    """The newest commit among markers found on any node (own or mirrored copies); none when a
    live node wrote its part of a newer save of the id whose marker no live node holds."""
    best: Manifest | None = None
    for blob in set(blobs):
        try:
            manifest = Manifest.from_json(blob, where=f"tier {tier.name}")
        except Exception as exc:  # noqa: BLE001 - one bad copy; others may do
            reasons.append(str(exc))
            continue
        if best is None or is_newer_commit(
            manifest.seq, manifest.generation, best.seq, best.generation
        ):
            best = manifest
    if best is None:
        return None, "; ".join(reasons) or "no commit marker on any node, own or mirrored"
    newer = inventory.newer_saves(best, probes)
    if newer:
        return None, (
            f"the newest marker held in memory names generation {best.generation} (commit"
            f" {best.seq}), but live nodes wrote their parts of a newer save of this id"
            f" ({', '.join(newer)}) whose commit no live node can confirm (its marker is not"
            " held by any): restoring the older contents under this id could undo that save"
        )
    return best.to_json(), None


def _keep_only_the_newest_commit(
    tiers: list[Tier], manifests: dict[int, Manifest], reasons: dict[int, list[str]]
) -> None:
    """Drop the copies of an older generation than the newest committed in any tier.

    An overwrite may commit in a lower tier (``tier=``) while a faster one still holds the previous
    generation: restoring the faster copy would serve stale data. Never: only the newest counts.
    """
    if not manifests:
        return
    newest = max(
        manifests.values(),
        key=lambda m: (m.seq is not None, m.seq or 0, m.generation),
    )
    for index in list(manifests):
        manifest = manifests[index]
        if manifest.generation != newest.generation and not is_newer_commit(
            manifest.seq, manifest.generation, newest.seq, newest.generation
        ):
            del manifests[index]
            reasons[index] = [
                f"holds generation {manifest.generation} (seq {manifest.seq}), older than"
                f" {newest.generation} (seq {newest.seq}) committed in another tier"
            ]


def choose_copy(
    tiers: list[Tier],
    checkpoint_id: str,
    *,
    node: int,
    verify: bool,
    group: dist.ProcessGroup | None = None,
    excluded: dict[int, str] | None = None,
    collective: bool = True,
) -> Choice:
    """Pick the fastest tier holding a usable committed copy; the same answer on every rank.

    ``excluded`` maps tier indexes already found unusable (and why) to skip. With
    ``collective=False`` this process decides alone, as a job of one rank would. Raises
    :class:`CheckpointNotFoundError` listing every tier looked at and why it was skipped.
    """
    rank, world = rank_and_world(group) if collective else (0, 1)
    found = _probe_markers(tiers, checkpoint_id) if rank == 0 else []
    found = broadcast_object(found, group) if collective else found
    mine = (node, _probe_mirrored(tiers, checkpoint_id))
    everyone = all_gather_object(mine, group) if collective else [mine]
    rank_nodes = [n for n, _ in everyone]
    for index, tier in enumerate(tiers):
        if tier.mirror is not None:
            blob, reason = found[index]
            blobs = [blob] if blob is not None else []
            probes = [p[index] for _, p in everyone if index in p]
            blobs += [b for probe in probes for b in probe.markers]
            other = [] if reason in (None, "no commit marker") else [f"node of rank 0: {reason}"]
            found[index] = _newest_marker(tier, blobs, other, probes)
    manifests: dict[int, Manifest] = {}
    reasons: dict[int, list[str]] = {}
    for index, (blob, reason) in enumerate(found):
        if blob is None:
            reasons[index] = [reason or "no commit marker"]
        else:
            manifests[index] = Manifest.from_json(blob, where=f"tier {tiers[index].name}")
    _keep_only_the_newest_commit(tiers, manifests, reasons)
    for index, reason in (excluded or {}).items():
        manifests.pop(index, None)
        reasons[index] = [reason]
    local: tuple[dict[int, list[str]], dict[int, dict[str, str]]] | Exception
    try:
        local = _check_share(
            tiers, manifests, rank=rank, world=world, rank_nodes=rank_nodes, verify=verify
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
        if tiers[index].mirror is not None:
            holdings[index] = inventory.by_node([h.get(index, {}) for _, h in gathered], rank_nodes)
            findings.append({index: inventory.unheld(manifest, holdings[index])})
    for index in manifests:
        issues = [p for item in findings for p in item.get(index, [])]
        if issues:
            reasons[index] = sorted(set(issues))
    for index in range(len(tiers)):
        if index in manifests and index not in reasons:
            if rank == 0:
                for skipped in range(index):
                    logger.warning(
                        "restore of %s: skipping tier %s: %s",
                        checkpoint_id,
                        tiers[skipped].name,
                        "; ".join(reasons.get(skipped, ["?"])),
                    )
            return Choice(index, manifests[index], holdings.get(index), rank_nodes)
    lines = [f"  {t.describe()}: {'; '.join(reasons.get(i, ['?']))}" for i, t in enumerate(tiers)]
    raise CheckpointNotFoundError(
        f"no tier holds a usable committed copy of checkpoint {checkpoint_id!r}:\n"
        + "\n".join(lines)
    )
