"""Auditing committed copies: is every marker backed by every byte it names?

The oracle behind ``tierstore verify --all`` and the test suites' fault scenarios. For every commit
marker in every tier it checks each named file's presence, size and CRC32C. A node-local copy's files
live on the nodes its marker says; given several node indexes (simulated nodes on one machine, or a
host that mounts every node's tier), each file is checked on its own node, so a multi-node copy is
audited whole. Files on nodes not given are counted as not checked, never as fine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tierstore._platform.progress import ByteProgress
from tierstore.config import Config
from tierstore.errors import IntegrityError, TierstoreError
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
) -> CopyAudit:
    """Audit the copy whose marker (read with ``trust``) is in ``tiers_by_node[marker_node]``; each
    file on its node (``show_progress``: a bar on a terminal while its bytes are read)."""
    tier = tiers_by_node[marker_node]
    try:
        manifest = read_manifest(tier, checkpoint_id, trust=trust)
    except IntegrityError as exc:
        return CopyAudit(tier.name, checkpoint_id, None, 0, 0, 0, (str(exc),))
    problems: list[str] = []
    checked = not_checked = 0
    by_node = _files_by_node(manifest, tier.node_local, marker_node)
    total = sum(e.size for n, es in by_node.items() if n in tiers_by_node for e in es)
    with ByteProgress(f"verify {checkpoint_id} in {tier.name}", total, enabled=show_progress) as bar:
        for node, entries in by_node.items():
            holder = tiers_by_node.get(node)
            if holder is None:
                not_checked += len(entries)
                continue
            try:
                problems += copy_problems(holder, manifest, verify=True, entries=entries, progress=bar.update)
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


def audit_all(config: Config, nodes: Iterable[int], *, show_progress: bool = False) -> list[CopyAudit]:
    """Every committed copy in every tier, as seen from ``nodes`` (see the module docstring);
    ``show_progress``: a bar per copy on a terminal."""
    nodes, trust = sorted(set(nodes)), config.marker_trust()
    audits: list[CopyAudit] = []
    for index, tier_config in enumerate(config.tiers):
        seen_from = nodes if tier_config.node_local else nodes[:1]
        tiers = {n: config.make_tiers(node=n)[index] for n in seen_from}
        for node, tier in tiers.items():
            for checkpoint_id in sorted(marker_times(tier)):
                audits.append(
                    audit_copy(tiers, checkpoint_id, node, trust=trust, show_progress=show_progress)
                )
    return audits
