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

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierstore._platform.bounded import Blame
from tierstore._platform.killpoints import kill_point
from tierstore._platform.progress import ByteProgress
from tierstore.errors import IntegrityError, TierstoreError
from tierstore.ids import intent_path, node_part_path
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.transfer import copy_files
from tierstore.records.activity import ACTIVITY_TTL, held
from tierstore.records.machine import part_path
from tierstore.records.marker import FileEntry, Manifest, read_manifest
from tierstore.records.parts import PartRecord
from tierstore.records.protocol import Verdict, drop, judge_promotion, publish, record_parts
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
_SWAP_ATTEMPTS = 8
"""How often a promotion judges a marker that other promotions keep swapping before it gives up."""


@dataclass(frozen=True)
class Outcome:
    """What one promotion did: bytes copied, and whether the target's marker is now published."""

    copied: int
    committed: bool
    verdict: Verdict | None = None
    """Where the target already held a marker of the id: how the two were judged."""
    existing: Manifest | None = None
    """The target's marker that stayed (``SAME``, ``KEEP_NEWER``, ``CONFLICT``)."""


def promoted_manifest(manifest: Manifest, source: Tier, *, durable: bool) -> Manifest:
    """The marker content for the target copy: same files, new commit time, provenance, lag."""
    now = time.time()
    first = (manifest.provenance or {}).get("first_committed_at", manifest.committed_at)
    timings = dict(manifest.timings)
    started = timings.get("started_at")
    if durable and started is not None:
        timings["durable_lag_s"] = now - float(started)
    provenance = {"tier": source.name, "committed_at": manifest.committed_at, "first_committed_at": first}
    return manifest.with_changes(committed_at=now, timings=timings, provenance=provenance)


def publish_committed(
    target: Tier,
    manifest: Manifest,
    *,
    trust: MarkerTrust,
    source_tier: str,
    node: int | None = None,
    ttl: float = ACTIVITY_TTL,
) -> tuple[Verdict | None, Manifest | None]:
    """Publish ``manifest`` as the target's marker (:func:`tierstore.records.protocol.publish`;
    the standing one read with ``trust``).

    Returns ``(None, None)`` when this call committed it. When the target already holds a marker of
    the id, the protocol judges the two (:func:`~tierstore.records.protocol.judge_promotion`): the
    newer commit of saves that knew of each other replaces the older (``REPLACE``, committed:
    ``(REPLACE, None)``); otherwise nothing changes and the verdict comes back with the target's
    manifest (``SAME``: another promoter won; ``KEEP_NEWER``; ``CONFLICT``: both contents kept).
    """
    existing = publish(target, manifest, trust=trust, replace=False, node=node, ttl=ttl)
    for _attempt in range(_SWAP_ATTEMPTS):
        if existing is None:
            return None, None
        verdict, _why = judge_promotion(manifest, existing, source_tier=source_tier, target=target.name)
        if verdict is not Verdict.REPLACE:
            return verdict, existing
        try:  # swapped only if the marker still names what was judged; else judged again
            expect = existing.generation
            existing = publish(target, manifest, trust=trust, replace=True, node=node, ttl=ttl, expect=expect)
        except FileNotFoundError:  # the judged marker was dropped meanwhile: create-only again
            existing = publish(target, manifest, trust=trust, replace=False, node=node, ttl=ttl)
            if existing is None:
                return None, None
            continue
        if existing is None:
            return Verdict.REPLACE, None
    raise TierstoreError(
        f"{manifest.checkpoint_id}: the marker in tier {target.describe()} changed under each of"
        f" {_SWAP_ATTEMPTS} attempts to replace it (other promoters?); the next pass tries again"
    )


def try_complete(target: Tier, checkpoint_id: str, generation: str, trust: MarkerTrust) -> bool:
    """Publish the marker if the target holds the manifest and every node's part; True if it did."""
    try:
        blob = target.read_bytes(intent_path(checkpoint_id, generation))
    except FileNotFoundError:
        return False
    manifest = Manifest.from_json(blob, where=f"tier {target.name}: {intent_path(checkpoint_id, generation)}")
    for node in manifest.nodes:
        if not target.exists(node_part_path(checkpoint_id, generation, node)):
            return False
    now = time.time()
    timings = dict(manifest.timings)
    if "durable_lag_s" in timings and timings.get("started_at") is not None:
        timings["durable_lag_s"] = now - float(timings["started_at"] or now)
    source = str((manifest.provenance or {}).get("tier", ""))
    verdict, _existing = publish_committed(
        target, manifest.with_changes(committed_at=now, timings=timings), trust=trust, source_tier=source
    )
    return verdict in (None, Verdict.REPLACE)


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
        trust: MarkerTrust,
        activity_ttl: float = ACTIVITY_TTL,
        progress: Callable[[int], None] = lambda _count: None,
        fence: Callable[[], bool] | None = None,
        blame: Blame | None = None,
    ) -> None:
        self.source, self.target, self.found = source, target, found
        self.blame = blame
        """Told of every read of the source (see :class:`~tierstore._platform.bounded.Blame`)."""
        self.progress = progress
        """Called with the bytes of every chunk copied (0: a chunk read back, a step done): a long
        copy is progress, not a hung promoter nor a hung tier."""
        self.fence = fence
        """Asked once the data is copied, before anything is published: False when this promoter
        no longer keeps the target (:mod:`tierstore.promote.keeper`); None: not the keeper's work."""
        self.node, self.durable, self.workers = node, durable, workers
        self.stopping, self.cancel = stopping, cancel
        self.activity_ttl, self.trust = activity_ttl, trust
        self.checkpoint_id = found.copy.checkpoint_id
        self.generation = found.copy.generation
        self._damaged = False
        """The source turned out damaged while copying: the copies go once the job is over."""

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
        try:
            with held(self.target, "promote", self.checkpoint_id, self.generation, ttl=self.activity_ttl):
                return self._run()
        except IntegrityError:
            if self._damaged:
                # The source is damaged: this will not get better by retrying. What was copied goes
                # through the protocol's drop, once this job's own record is released: another
                # promoter may be publishing this very generation's copies, which must stay.
                ckpt, gen, ttl = self.checkpoint_id, self.generation, self.activity_ttl
                drop(self.target, ckpt, gen, trust=self.trust, committed=False, ttl=ttl)
            raise

    def _run(self) -> Outcome:
        entries, multi_node = self._entries()
        part = node_part_path(self.checkpoint_id, self.generation, self.node)
        if multi_node and not self.target.node_local and self.target.exists(part):
            return Outcome(0, try_complete(self.target, self.checkpoint_id, self.generation, self.trust))
        if (judged := self._judge_before_copying()) is not None:
            return judged  # the target's copy of the id stays: nothing to copy
        self.progress(0)
        label = f"promote {self.checkpoint_id} {self.source.name}->{self.target.name}"
        progress = ByteProgress(label, sum(e.size for e in entries))

        def copied_chunk(count: int) -> None:
            progress.update(count)
            self.progress(count)

        try:
            with progress:
                copied = copy_files(
                    self.source,
                    self.target,
                    self.checkpoint_id,
                    entries,
                    workers=self.workers,
                    stopping=self.stopping,
                    cancel=self.cancel,
                    progress=copied_chunk,
                    blame=self.blame,
                )
        except IntegrityError:
            self._damaged = True
            raise
        if self.cancel.is_set():  # asked to abandon: publish nothing, even if the files made it
            return Outcome(copied, False)
        if self.fence is not None and not self.fence():  # another promoter keeps the target now
            return Outcome(copied, False)
        kill_point("promote.data_copied", self.checkpoint_id)
        self.progress(0)
        manifest = self.found.manifest
        if self.target.node_local:
            if self.found.parts:  # other nodes' promoters find their parts by these
                writes = [(part_path(record), record.to_json()) for record in self.found.parts]
                record_parts(self.target, self.checkpoint_id, writes)  # this node's promoter lists them
            if manifest is None:
                return Outcome(copied, False)
            return self._publish(copied, manifest, node=self.node)
        if not multi_node:
            assert manifest is not None
            return self._publish(copied, manifest)
        self._record_part(entries, manifest)
        return Outcome(copied, try_complete(self.target, self.checkpoint_id, self.generation, self.trust))

    def _judge_before_copying(self) -> Outcome | None:
        """Where the target already holds a marker of the id, the protocol's judgement, before a
        byte is copied: an Outcome when the target's copy stays (the same generation, a newer
        commit, a conflict), None when the copy goes ahead (the id is not there, or is replaced)."""
        source = self.found.manifest
        if source is None:
            return None
        try:
            existing = read_manifest(self.target, self.checkpoint_id, trust=self.trust)
        except (FileNotFoundError, NotADirectoryError):
            return None
        verdict, _why = judge_promotion(
            source, existing, source_tier=self.source.name, target=self.target.name
        )
        return None if verdict is Verdict.REPLACE else Outcome(0, False, verdict, existing)

    def _publish(self, copied: int, manifest: Manifest, *, node: int | None = None) -> Outcome:
        verdict, existing = publish_committed(
            self.target,
            self._promoted(manifest),
            trust=self.trust,
            source_tier=self.source.name,
            node=node,
            ttl=self.activity_ttl,
        )
        return Outcome(copied, verdict in (None, Verdict.REPLACE), verdict, existing)

    def _promoted(self, manifest: Manifest) -> Manifest:
        return promoted_manifest(manifest, self.source, durable=self.durable)

    def _record_part(self, entries: list[FileEntry], manifest: Manifest | None) -> None:
        ranks = tuple(sorted({e.rank for e in entries if e.rank is not None}))
        seq = manifest.seq if manifest else self.found.copy.seq
        world = manifest.world_size if manifest else self.found.parts[0].world_size
        record = PartRecord(self.checkpoint_id, self.generation, self.node, ranks, tuple(entries), seq, world)
        writes = []
        if manifest is not None:  # the coordinator's node: leave the committed manifest first
            if manifest.generation != self.generation:
                raise IntegrityError(f"{self.checkpoint_id}: generation changed during promotion")
            intent = self._promoted(manifest).to_json()
            writes.append((intent_path(self.checkpoint_id, self.generation), intent))
        writes.append((node_part_path(self.checkpoint_id, self.generation, self.node), record.to_json()))
        record_parts(self.target, self.checkpoint_id, writes, listed=False)
