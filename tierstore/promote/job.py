"""One promotion: this node's part of a committed checkpoint, copied into the next tier, marker last.

The protocol, for a checkpoint ``id`` of generation ``gen``, from ``source`` to ``target``:

1. Copy this node's files (and, from the coordinator's node, DCP's ``.metadata``), each verified
   against its size and CRC32C (:mod:`tierstore.promote.transfer`).
2. If every file of the checkpoint is on this node (one node), publish the marker in ``target``:
   create-only, so two promoters racing on one target cannot both commit. Done.
3. Otherwise (several nodes, a job-wide target): record this node's part in the target
   (``parts/nodeNNNNN.json``); the coordinator's node also leaves the committed manifest
   (``parts/manifest.json``). Whichever promoter then sees the manifest and every node's part publishes
   the marker, create-only. A node-local target holds only this node's part: the coordinator's node
   publishes its marker when its own part is there, other nodes keep the per-rank part records.

The marker is never written before the data it names is complete. Killed at any point, a rerun redoes
the copy (verified files already in a POSIX target are kept) and the marker step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.errors import IntegrityError
from tierstore.ids import (
    checkpoint_file,
    generation_dir,
    intent_path,
    is_newer_commit,
    marker_path,
    node_part_path,
    rank_part_path,
)
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.progress import TransferProgress
from tierstore.promote.transfer import copy_files
from tierstore.records.activity import ACTIVITY_TTL, held, is_busy, live
from tierstore.records.log import LogEntry, forget, record
from tierstore.records.marker import (
    FileEntry,
    Manifest,
    copy_problems,
    publish_manifest,
    read_manifest,
)
from tierstore.records.parts import PartRecord
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What one promotion did: bytes copied, and whether the target's marker is now published."""

    copied: int
    committed: bool


def promoted_manifest(manifest: Manifest, source: Tier, *, durable: bool) -> Manifest:
    """The marker content for the target copy: same files, new commit time, provenance, lag."""
    now = time.time()
    first = (manifest.provenance or {}).get("first_committed_at", manifest.committed_at)
    timings = dict(manifest.timings)
    started = timings.get("started_at")
    if durable and started is not None:
        timings["durable_lag_s"] = now - float(started)
    provenance = {
        "tier": source.name,
        "committed_at": manifest.committed_at,
        "first_committed_at": first,
    }
    return manifest.with_changes(committed_at=now, timings=timings, provenance=provenance)


def publish_committed(target: Tier, manifest: Manifest, *, node: int | None = None) -> bool:
    """Publish ``manifest`` as the target's marker, create-only; True if this call committed it.

    First every file the marker names (in a node-local target: those of ``node``) is checked to be
    there at its size: nothing may have removed a copied file since, or the marker would stand over
    a hole. If the target already holds a marker of the same generation, another promoter won:
    nothing changes. If it holds an older generation (the id was overwritten at the source), the
    marker is replaced atomically and the old generation deleted afterwards.
    """
    here = [f for f in manifest.files if not target.node_local or node is None or f.node == node]
    problems = copy_problems(target, manifest, verify=False, entries=here)
    if problems:
        raise IntegrityError(
            f"{manifest.checkpoint_id}: not committed in tier {target.describe()}: files"
            f" vanished before the marker: {'; '.join(problems)}"
        )
    try:
        publish_manifest(target, manifest, create_only=True)
    except FileExistsError:
        existing = read_manifest(target, manifest.checkpoint_id)
        if existing.generation == manifest.generation:
            return False  # another promoter committed it
        if not is_newer_commit(
            manifest.seq, manifest.generation, existing.seq, existing.generation
        ):
            return False  # the target already has a newer generation
        publish_manifest(target, manifest, create_only=False)
        forget(target, manifest.checkpoint_id, existing.generation)
        readers = [r for r in live(target) if r.kind == "read"]
        if not is_busy(readers, manifest.checkpoint_id, existing.generation):  # else: cleanup's
            target.delete_tree(generation_dir(manifest.checkpoint_id, existing.generation))
    problems = copy_problems(target, manifest, verify=False, entries=here)
    if problems:  # cleanup on another node removed files that pre-existed this job: withdraw
        target.delete(marker_path(manifest.checkpoint_id))
        raise IntegrityError(
            f"{manifest.checkpoint_id}: marker withdrawn from tier {target.describe()}: files"
            f" removed while it was published: {'; '.join(problems)}"
        )
    if manifest.seq is not None:  # the copy keeps its place in commit order in this tier too
        record(target, LogEntry(manifest.seq, manifest.checkpoint_id, manifest.generation))
    return True


def try_complete(target: Tier, checkpoint_id: str, generation: str) -> bool:
    """Publish the marker if the target holds the manifest and every node's part; True if it did."""
    try:
        blob = target.read_bytes(intent_path(checkpoint_id, generation))
    except FileNotFoundError:
        return False
    manifest = Manifest.from_json(
        blob, where=f"tier {target.name}: {intent_path(checkpoint_id, generation)}"
    )
    for node in manifest.nodes:
        if not target.exists(node_part_path(checkpoint_id, generation, node)):
            return False
    now = time.time()
    timings = dict(manifest.timings)
    if "durable_lag_s" in timings and timings.get("started_at") is not None:
        timings["durable_lag_s"] = now - float(timings["started_at"] or now)
    return publish_committed(target, manifest.with_changes(committed_at=now, timings=timings))


class PromotionJob:
    """Carries out one promotion for the promoter on ``node`` (see the module docstring)."""

    def __init__(
        self,
        source: Tier,
        target: Tier,
        found: SeenCopy,
        *,
        node: int,
        durable: bool,
        workers: int,
        stopping: threading.Event,
        cancel: threading.Event,
        activity_ttl: float = ACTIVITY_TTL,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self.source, self.target, self.found = source, target, found
        self.heartbeat = heartbeat
        """Called for every chunk copied: a long copy is progress, not a hung promoter."""
        self.node, self.durable, self.workers = node, durable, workers
        self.stopping, self.cancel = stopping, cancel
        self.activity_ttl = activity_ttl
        self.checkpoint_id = found.copy.checkpoint_id
        self.generation = found.copy.generation

    def _entries(self) -> tuple[list[FileEntry], bool]:
        """This node's files to copy, and whether other nodes hold parts of the checkpoint."""
        manifest = self.found.manifest
        if manifest is None:
            files = [f for record in self.found.parts for f in record.files]
            return files, True
        if not self.source.node_local:
            return list(manifest.files), False
        mine = [f for f in manifest.files if f.node == self.node]
        return mine, manifest.nodes != [self.node]

    def run(self) -> Outcome:
        """Copy, then publish or record the part; raises on failure (nothing half-visible).

        A ``promote`` activity record in the target covers the whole job: cleanup on any node
        leaves the generation alone while it is being copied, however idle its files look.
        """
        with held(
            self.target, "promote", self.checkpoint_id, self.generation, ttl=self.activity_ttl
        ):
            return self._run()

    def _run(self) -> Outcome:
        entries, multi_node = self._entries()
        part = node_part_path(self.checkpoint_id, self.generation, self.node)
        if multi_node and not self.target.node_local and self.target.exists(part):
            return Outcome(0, try_complete(self.target, self.checkpoint_id, self.generation))
        label = f"{self.checkpoint_id} {self.source.name}->{self.target.name}"
        progress = TransferProgress(label, sum(e.size for e in entries))

        def copied_chunk(count: int) -> None:
            progress.update(count)
            if self.heartbeat is not None:
                self.heartbeat()

        try:
            copied = copy_files(
                self.source, self.target, self.checkpoint_id, entries, workers=self.workers,
                stopping=self.stopping, cancel=self.cancel, progress=copied_chunk,
            )  # fmt: skip
        except IntegrityError:
            # The source is damaged: this will not get better by retrying. Remove what was copied.
            for entry in entries:
                with contextlib.suppress(Exception):
                    self.target.delete(checkpoint_file(self.checkpoint_id, entry.path))
            raise
        if self.cancel.is_set():  # asked to abandon: publish nothing, even if the files made it
            return Outcome(copied, False)
        manifest = self.found.manifest
        if self.target.node_local:
            for record in self.found.parts:  # other nodes' promoters find their parts through these
                path = rank_part_path(self.checkpoint_id, self.generation, record.ranks[0])
                self.target.write_bytes(path, record.to_json())
            if manifest is None:
                return Outcome(copied, False)
            promoted = self._promoted(manifest)
            return Outcome(copied, publish_committed(self.target, promoted, node=self.node))
        if not multi_node:
            assert manifest is not None
            return Outcome(copied, publish_committed(self.target, self._promoted(manifest)))
        self._record_part(entries, manifest)
        return Outcome(copied, try_complete(self.target, self.checkpoint_id, self.generation))

    def _promoted(self, manifest: Manifest) -> Manifest:
        return promoted_manifest(manifest, self.source, durable=self.durable)

    def _record_part(self, entries: list[FileEntry], manifest: Manifest | None) -> None:
        ranks = tuple(sorted({e.rank for e in entries if e.rank is not None}))
        seq = manifest.seq if manifest else self.found.copy.seq
        world = manifest.world_size if manifest else self.found.parts[0].world_size
        record = PartRecord(
            self.checkpoint_id, self.generation, self.node, ranks, tuple(entries), seq, world
        )
        if manifest is not None:  # the coordinator's node: leave the committed manifest first
            if manifest.generation != self.generation:
                raise IntegrityError(f"{self.checkpoint_id}: generation changed during promotion")
            self.target.write_bytes(
                intent_path(self.checkpoint_id, self.generation), self._promoted(manifest).to_json()
            )
        self.target.write_bytes(
            node_part_path(self.checkpoint_id, self.generation, self.node), record.to_json()
        )
