"""Auditing committed copies: is every marker backed by every byte it names?

The oracle behind ``tierstore verify --all`` and the test suites' fault scenarios. For every commit
marker in every tier it checks each named file's presence, size and CRC32C. A node-local copy's files
live on the nodes its marker says; given several node indexes (simulated nodes on one machine, or a
host that mounts every node's tier), each file is checked on its own node, so a multi-node copy is
audited whole. Files on nodes not given are counted as not checked, never as fine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierstore._platform.bounded import Prober
from tierstore._platform.progress import ByteProgress
from tierstore.config import Config
from tierstore.errors import IntegrityError, TierstoreError, TierUnavailableError, one_line
from tierstore.records.catalog import marker_times
from tierstore.records.marker import FileEntry, Manifest, copy_problems, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier


@dataclass(frozen=True)
class CopyAudit:
    """The verdict on one committed copy: ``problems`` is empty when every named file checked out."""

    tier: str
    checkpoint_id: str
    generation: str | None
    checked: int
    not_checked: int
    total_bytes: int
    problems: tuple[str, ...]
    unreachable: str | None = None
    """Why the tier did not answer within the deadline (nothing checked; ``checkpoint_id`` is
    empty when the tier could not even be listed)."""

    @property
    def ok(self) -> bool:
        """True when nothing named by the marker is missing, short, long or corrupt."""
        return not self.problems


def audit_copy(
    tiers_by_node: dict[int, Tier],
    checkpoint_id: str,
    marker_node: int,
    *,
    trust: MarkerTrust,
    show_progress: bool = False,
    progress: Callable[[int], None] = lambda _count: None,
) -> CopyAudit:
    """Audit the copy whose marker (read with ``trust``) is in ``tiers_by_node[marker_node]``; each
    file on its node (``show_progress``: a bar on a terminal while its bytes are read; ``progress``
    is told of each chunk read)."""
    tier = tiers_by_node[marker_node]
    try:
        manifest = read_manifest(tier, checkpoint_id, trust=trust)
    except IntegrityError as exc:
        return CopyAudit(tier.name, checkpoint_id, None, 0, 0, 0, (str(exc),))
    problems: list[str] = []
    checked = not_checked = 0
    by_node = _files_by_node(manifest, tier.node_local, marker_node)
    total = sum(e.size for n, es in by_node.items() if n in tiers_by_node for e in es)
    progress(0)
    with ByteProgress(f"verify {checkpoint_id} in {tier.name}", total, enabled=show_progress) as bar:

        def told(count: int) -> None:
            bar.update(count)
            progress(count)

        for node, entries in by_node.items():
            holder = tiers_by_node.get(node)
            if holder is None:
                not_checked += len(entries)
                continue
            try:
                problems += copy_problems(holder, manifest, verify=True, entries=entries, progress=told)
            except (TierstoreError, OSError) as exc:
                problems.append(f"node {node}: cannot read: {exc}")
            checked += len(entries)
    return CopyAudit(
        tier.name,
        checkpoint_id,
        manifest.generation,
        checked,
        not_checked,
        manifest.total_bytes,
        tuple(problems),
    )


def _files_by_node(manifest: Manifest, node_local: bool, marker_node: int) -> dict[int, list[FileEntry]]:
    """Where each named file lives: on its writer's node in a node-local tier, else with the marker."""
    grouped: dict[int, list[FileEntry]] = {}
    for entry in manifest.files:
        grouped.setdefault(entry.node if node_local else marker_node, []).append(entry)
    return grouped


def audit_all(
    config: Config, nodes: Iterable[int], *, show_progress: bool = False, prober: Prober | None = None
) -> list[CopyAudit]:
    """Every committed copy in every tier, as seen from ``nodes`` (see the module docstring);
    ``show_progress``: a bar per copy on a terminal. With a ``prober``, a tier that does not answer
    within its deadline (a listing, or a copy's reads making no progress) is recorded as
    ``unreachable`` and the others go on; without, its error is raised."""
    nodes, trust = sorted(set(nodes)), config.marker_trust()
    audits: list[CopyAudit] = []
    for index, tier_config in enumerate(config.tiers):
        seen_from = nodes if tier_config.node_local else nodes[:1]
        tiers = {n: config.make_tiers(node=n)[index] for n in seen_from}
        for node, tier in tiers.items():
            audit = functools.partial(
                audit_copy, tiers, marker_node=node, trust=trust, show_progress=show_progress
            )
            if prober is None:
                audits += [audit(checkpoint_id) for checkpoint_id in sorted(marker_times(tier))]
                continue
            try:
                ids = sorted(prober.ask(tier, functools.partial(marker_times, tier), what="list its markers"))
                for checkpoint_id in ids:
                    audits.append(
                        prober.watch(tier, _told(audit, checkpoint_id), what=f"verify {checkpoint_id}")
                    )
            except TierUnavailableError as exc:
                audits.append(CopyAudit(tier.name, "", None, 0, 0, 0, (), unreachable=one_line(str(exc))))
    return audits


def _told(
    audit: Callable[..., CopyAudit], checkpoint_id: str
) -> Callable[[Callable[[int], None]], CopyAudit]:
    """The audit of ``checkpoint_id`` as work a :meth:`Prober.watch` hands its progress callback."""
    return lambda progress: audit(checkpoint_id, progress=progress)
