"""``TieredReader``: a DCP ``StorageReader`` that restores from the fastest usable committed copy.

Call order (``dcp.load``): ``reset(checkpoint_id)`` if an id is given, then on every rank inside DCP's
collective wrapper :meth:`TieredReader.read_metadata` (the collective tier choice of
:mod:`tierstore.dcp.restore_choice`, then DCP's ``.metadata`` from the chosen tier, checked against
its CRC32C and unpickled with an allowlist), ``set_up_storage_reader``, the plans, and
:meth:`TieredReader.read_data`.

Reads go straight into the destination tensors when they can (``preadv`` on POSIX tiers into a
contiguous CPU tensor that takes a whole stored chunk); otherwise the bytes are read and copied. Files
are read in parallel. Resharding (another world size than the save's) is DCP's planner's job: the reader
only serves byte ranges, so it works from any tier.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierstore.bounded import Prober
from tierstore.checksum import crc32c, sha256_hex
from tierstore.config import Config, as_config
from tierstore.dcp.collectives import ALONE, broadcast_object, rank_and_world
from tierstore.dcp.item_check import ATTEMPTS, is_intact, read_checked
from tierstore.dcp.layout import CHUNK, ItemLocation, decode_tensor, memory_of
from tierstore.dcp.mirror.groups import job_groups
from tierstore.dcp.mirror.inventory import stored_path
from tierstore.dcp.mirror.peer_read import fetch_missing
from tierstore.dcp.mirror.transport import bytes_of
from tierstore.dcp.object_read import in_place_target, pieces
from tierstore.dcp.restore_choice import Choice, choose_copy
from tierstore.dcp.safe_pickle import load_metadata
from tierstore.errors import IntegrityError, TierstoreError
from tierstore.ids import (
    checkpoint_file,
    is_checkpoint_id,
    is_metadata_file,
    validate_checkpoint_id,
)
from tierstore.records.activity import Activity, hold
from tierstore.records.marker import Manifest, entry_problem
from tierstore.records.sightings import trust_period
from tierstore.tiers import Tier
from tierstore.topology import current_node

logger = logging.getLogger(__name__)
_WHOLE_FILE_FRACTION = 0.5
"""Read an object in large GETs when the items need more than this share of it, else item by item."""
_READ_WORKERS = max(2, min(8, os.cpu_count() or 2))


class TieredReader(StorageReader):
    """Load DCP checkpoints from the fastest tier holding a usable committed copy.

    Args:
        config: a loaded :class:`~tierstore.config.Config` or the path of a YAML file.
        checkpoint_id: the id to load when ``dcp.load`` is called without one.
        node: this process's node index for node-local tiers (default: :func:`current_node`).
        verify: check every file's CRC32C before choosing a tier (default: ``verify_on_load``).
        process_group: the group passed to ``dcp.load`` (default: the default group).
        collective: False when this process loads alone in a job whose other ranks do not load
            (``dcp.load(..., no_dist=True)``): the tier is then chosen by this process alone, and a
            mirrored memory tier serves only what this node holds. DCP tells a reader nothing of
            ``no_dist``, so without this the load waits in a collective the other ranks never join.

    Raises (through DCP): :class:`~tierstore.errors.CheckpointNotFoundError` listing every tier and
    why it was skipped; :class:`~tierstore.errors.IntegrityError` for a corrupt ``.metadata``.
    """

    def __init__(
        self,
        config: Config | str | os.PathLike[str],
        *,
        checkpoint_id: str | None = None,
        node: int | None = None,
        verify: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        collective: bool = True,
    ) -> None:
        super().__init__()
        self.config = as_config(config)
        self.node = current_node(node)
        self.signing = self.config.signing.keys() is not None
        # With the job's key, every file is checked against its signed SHA-256 before the tier is
        # chosen: a tier writer could otherwise swap a data file whose byte items DCP unpickles.
        self.verify = (self.config.verify_on_load if verify is None else verify) or self.signing
        self.collective = collective
        self.process_group = process_group if collective else ALONE
        self._checkpoint_id = (
            None if checkpoint_id is None else validate_checkpoint_id(checkpoint_id)
        )
        self._tiers: list[Tier] | None = None
        self._tier: Tier | None = None
        self._storage: dict[Any, ItemLocation] = {}
        self._reading: dict[str, Activity] = {}
        self._bytes_read = 0
        self._count_lock = threading.Lock()
        self._choice: Choice | None = None
        self._prober = Prober(self.config.probe_timeout)
        self._began = (0.0, 0)
        """When the current load's ``read_metadata`` began, and :attr:`bytes_read` then (for the
        load's log line)."""

    @property
    def checkpoint_id(self) -> str | None:
        """The id being (or to be) loaded."""
        return self._checkpoint_id

    @property
    def chosen_tier(self) -> str | None:
        """The name of the tier the last load read from (None before a load)."""
        return self._tier.name if self._tier else None

    @property
    def bytes_read(self) -> int:
        """Bytes this reader read from storage (``.metadata`` and data), over all its loads."""
        return self._bytes_read

    def _count(self, size: int) -> None:
        with self._count_lock:  # read_data reads on several threads
            self._bytes_read += size

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when ``checkpoint_id`` is a valid tierstore id."""
        return isinstance(checkpoint_id, str) and is_checkpoint_id(checkpoint_id)

    def tiers(self) -> list[Tier]:
        """Every configured tier, fastest first, as seen from this node."""
        if self._tiers is None:
            self._tiers = self.config.make_tiers(node=self.node)
        return self._tiers

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Select the checkpoint to load (validated)."""
        self._stop_reading()  # a previous load that failed before read_data
        if checkpoint_id is not None:
            self._checkpoint_id = validate_checkpoint_id(checkpoint_id)
        self._tier, self._storage, self._choice = None, {}, None

    def _hold_read(self, index: int) -> None:
        """Announce the restore in ``tiers()[index]`` before the tier is looked at.

        Cleanup and retention leave a checkpoint alone while a live ``read`` record names it. Every
        rank holds its own, in each tier the choice looks at (fastest first, only as far as
        needed): ranks finish reading at different times, and DCP tells a rank nothing after its
        own ``read_data``. A tier that cannot take the record is logged and still considered: the
        restore itself says whether it is usable.
        """
        tier = self.tiers()[index]
        if tier.name in self._reading or self._checkpoint_id is None:
            return
        announce = functools.partial(
            hold, tier, "read", self._checkpoint_id, None, ttl=self.config.promote.activity_ttl
        )
        try:  # within probe_timeout: a hung tier must not hold the restore (a late one is undone)
            self._reading[tier.name] = self._prober.ask(
                tier.name, announce, what="announce the restore", on_late=Activity.release,
                direct=tier.capabilities.staging_files,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the restore decides what is usable
            logger.warning("could not announce the restore of %s in %s: %s",
                           self._checkpoint_id, tier.name, exc)  # fmt: skip

    def _stop_reading(self, keep: str | None = None) -> None:
        """Release the ``read`` records (all, or all but the tier called ``keep``)."""
        for name in [n for n in self._reading if n != keep]:
            self._reading.pop(name).release()

    def read_metadata(self, *args: Any, **_ignored: Any) -> Metadata:
        """Choose the tier (collectively) and return DCP's metadata from it."""
        if self._checkpoint_id is None:
            raise TierstoreError(
                "no checkpoint id: pass checkpoint_id= to dcp.load or TieredReader"
            )
        self._began = (time.monotonic(), self._bytes_read)
        mirrored = [t.mirror for t in self.tiers() if t.mirror is not None]
        if mirrored and self.collective:  # every rank reads metadata; created once per job
            job_groups(mirrored[0].timeout)
        try:
            return self._choose_and_read_metadata(self._checkpoint_id)
        except BaseException:
            self._stop_reading()
            raise

    def _choose_and_read_metadata(self, checkpoint_id: str) -> Metadata:
        tiers = self.tiers()
        excluded: dict[int, str] = {}
        while True:  # every rank runs the same iterations: each step's outcome is broadcast
            choice = choose_copy(
                tiers,
                checkpoint_id,
                node=self.node,
                verify=self.verify,
                group=self.process_group,
                excluded=excluded,
                prober=self._prober,
                before_probe=self._hold_read,
                sighting_trust=trust_period(self.config.promote.interval),
                collective=self.collective,
            )
            tier, manifest = tiers[choice.tier_index], choice.manifest
            self._choice = choice
            blob, where = self._fetch_metadata(tier, manifest)
            if isinstance(blob, bytes):
                break
            logger.warning("restore of %s: skipping tier %s: %s", checkpoint_id, tier.name, blob)
            excluded[choice.tier_index] = blob
        metadata = load_metadata(blob, where=where)
        if not isinstance(metadata, Metadata):
            raise IntegrityError(f"{where}: not DCP metadata")
        _check_item_locations(metadata, manifest, where)
        self._tier = tier
        if rank_and_world(self.process_group)[0] == 0:
            logger.info("restore of %s: from tier %s (commit %s, generation %s), the fastest with"
                        " a usable copy", checkpoint_id, tier.name, manifest.seq,
                        manifest.generation)  # fmt: skip
        self._stop_reading(keep=tier.name)  # other tiers may trim this id again
        self._storage = dict(metadata.storage_data or {})
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def _fetch_metadata(self, tier: Tier, manifest: Manifest) -> tuple[bytes | str, str]:
        """Coordinator reads ``.metadata`` and checks it against the marker; shared by broadcast.

        Returns the bytes, or a string saying why they are unusable.
        """
        entry = next((f for f in manifest.files if is_metadata_file(f.path)), None)
        if entry is None:
            return f"the marker of {self._checkpoint_id} names no .metadata file", tier.name
        path = checkpoint_file(manifest.checkpoint_id, entry.path)
        where = f"tier {tier.name}: {path}"
        rank, _ = rank_and_world(self.process_group)
        source = self._metadata_reader(entry.path)
        blob: bytes | str = b""
        if rank == source:
            try:
                path = self._stored(entry.path)
                blob = tier.read_bytes(path)
                self._count(len(blob))
                # Checked before anything unpickles it: a signed marker's SHA-256 too.
                sha = sha256_hex(blob) if entry.sha256 is not None else None
                blob = entry_problem(path, entry, len(blob), crc32c(blob), sha) or blob
            except Exception as exc:  # noqa: BLE001 - shared with every rank, then acted on
                blob = f"{path}: {exc}"
        return broadcast_object(blob, self.process_group, src=source), where

    def _metadata_reader(self, rel: str) -> int:
        """The rank that reads ``.metadata``: rank 0, or in a mirrored memory tier the first rank
        on a node that holds it (own or mirrored; the coordinator's node may be gone)."""
        choice = self._choice
        if choice is None or choice.holdings is None:
            return 0
        return next(
            r for r, node in enumerate(choice.rank_nodes) if rel in choice.holdings.get(node, {})
        )

    def _stored(self, rel: str) -> str:
        """Tier-relative path of a file the marker names, as this node holds it."""
        assert self._checkpoint_id is not None
        choice = self._choice
        if choice is None or choice.holdings is None:
            return checkpoint_file(self._checkpoint_id, rel)
        rank, _ = rank_and_world(self.process_group)
        mine: dict[str, str] = choice.holdings.get(choice.rank_nodes[rank], {})
        return stored_path(self._checkpoint_id, rel, mine.get(rel, "own"))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item locations of the chosen copy."""
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` from the chosen tier, in parallel.

        POSIX tiers: tensors are read straight into their destinations by several threads at once
        (``preadv`` copies in the kernel, so they run in parallel); byte items are loaded afterwards
        on this thread, since loading them changes the caller's state dict. Object stores: each
        file is fetched with parallel ranged GETs, then decoded.
        """
        if self._tier is None or self._checkpoint_id is None:
            raise TierstoreError("read_data() before read_metadata()")
        tier = self._tier
        requests = sorted(
            ((item, self._storage[item.storage_index]) for item in plan.items),
            key=lambda r: (r[1].path, r[1].offset),
        )
        try:
            requests = self._serve_from_peers(requests, planner)
            if self.signing:  # byte items are unpickled: only from bytes checked as they are read
                self._read_whole_files([r for r in requests if r[0].type == LoadItemType.BYTE_IO],
                                       planner, signed=True)  # fmt: skip
                requests = [r for r in requests if r[0].type != LoadItemType.BYTE_IO]
            # Saved before items carried a CRC32C: their files are read whole and checked.
            self._read_whole_files([r for r in requests if r[1].crc is None], planner)
            requests = [r for r in requests if r[1].crc is not None]
            if tier.capabilities.local_files:
                tensors = [r for r in requests if r[0].type != LoadItemType.BYTE_IO]
                with ThreadPoolExecutor(_READ_WORKERS, thread_name_prefix="tierstore-read") as pool:
                    batches = _balanced(tensors, _READ_WORKERS)
                    list(pool.map(lambda batch: self._read_items(batch, planner), batches))
                self._read_items(
                    [r for r in requests if r[0].type == LoadItemType.BYTE_IO], planner
                )
            else:
                per_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
                for request in requests:
                    per_file[request[1].path].append(request)
                # The sizes the marker records (checked when the copy was chosen): no HEAD each.
                manifest = self._choice.manifest if self._choice is not None else None
                sizes = {f.path: f.size for f in manifest.files} if manifest is not None else {}
                for path, file_requests in per_file.items():
                    self._read_object(path, file_requests, planner, sizes.get(path))
        finally:  # the data is in memory: cleanup and retention may act on this id again
            self._stop_reading()
        if rank_and_world(self.process_group)[0] == 0:
            began, bytes_before = self._began
            logger.info("restored %s from tier %s: rank 0 read %d bytes, %.2f s since the load"
                        " began", self._checkpoint_id, tier.name, self._bytes_read - bytes_before,
                        time.monotonic() - began)  # fmt: skip
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_whole_files(
        self,
        requests: list[tuple[ReadItem, ItemLocation]],
        planner: LoadPlanner,
        *,
        signed: bool = False,
    ) -> None:
        """Each file holding some of ``requests`` is read whole, once, and checked against its
        marker entry before any of its items is delivered: byte items of a signed checkpoint
        (``signed``: DCP unpickles them, so the signed SHA-256 must match, a CRC32C can be
        forged), and items saved without a CRC32C of their own. A mismatch raises
        :class:`IntegrityError` naming tier and file."""
        assert self._tier is not None and self._choice is not None
        entries = {f.path: f for f in self._choice.manifest.files}
        per_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        for request in requests:
            per_file[request[1].path].append(request)
        for rel, file_requests in per_file.items():
            full, entry = self._stored(rel), entries.get(rel)
            if entry is None:
                raise IntegrityError(f"tier {self._tier.name}: {full}: not named by the marker")
            blob = self._tier.read_bytes(full)
            self._count(len(blob))
            sha = sha256_hex(blob) if signed or entry.sha256 is not None else None
            problem = entry_problem(full, entry, len(blob), crc32c(blob), sha)
            if problem is not None or (signed and entry.sha256 is None):
                raise IntegrityError(f"tier {self._tier.name}: {problem or full + ': no SHA-256'}")
            for item, location in file_requests:
                data = memoryview(blob)[location.offset : location.offset + location.length]
                self._deliver(item, location, data, planner)

    def _serve_from_peers(
        self, requests: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner
    ) -> list[tuple[ReadItem, ItemLocation]]:
        """Mirrored memory tier: receive the files this node lacks from peers (a collective every
        rank joins), load their items from memory; returns the requests left to read locally."""
        choice, tier = self._choice, self._tier
        if choice is None or choice.holdings is None or tier is None or tier.mirror is None:
            return requests
        if not self.collective:
            return requests  # alone: no peer sends anything
        groups = job_groups(tier.mirror.timeout)
        if groups is None:
            return requests
        received = fetch_missing(
            tier, choice.manifest, choice.holdings, choice.rank_nodes,
            {location.path for _, location in requests},
            group=groups.restore, timeout_s=tier.mirror.timeout,
        )  # fmt: skip
        for item, location in requests:
            if location.path in received:
                whole = bytes_of(received[location.path])
                part = whole[location.offset : location.offset + location.length]
                self._deliver(item, location, part, planner)
        return [r for r in requests if r[1].path not in received]

    def _read_items(
        self, requests: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner
    ) -> None:
        assert self._tier is not None and self._checkpoint_id is not None
        for item, location in requests:
            full = self._stored(location.path)
            if item.type != LoadItemType.BYTE_IO and self._read_in_place(
                self._tier, full, item, location, planner
            ):
                continue
            data = memoryview(bytearray(location.length))
            self._read_checked(full, location, data)  # byte items too: before DCP unpickles them
            self._count(location.length)
            self._deliver(item, location, data, planner)

    def _read_checked(
        self, full: str, location: ItemLocation, out: memoryview, attempts: int = ATTEMPTS
    ) -> None:
        """Read an item into ``out``, checked against its CRC32C (:mod:`.item_check`)."""
        assert self._tier is not None
        tier = self._tier
        # POSIX: chunked reads, each summed while cache-hot; an object store: one request.
        chunk = CHUNK if tier.capabilities.local_files else max(1, len(out))
        fill = functools.partial(tier.read_into, full)
        read_checked(fill, location, out, tier=tier.name, full=full, attempts=attempts, chunk=chunk)

    def _deliver(
        self,
        item: ReadItem,
        location: ItemLocation,
        data: bytearray | memoryview,
        planner: LoadPlanner,
    ) -> None:
        if len(data) != location.length:
            raise IntegrityError(
                f"tier {self.chosen_tier}: {location.path}: short read at {location.offset}"
            )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(data)))
        else:
            _copy_into(planner, item, decode_tensor(data, location))

    def _read_object(
        self,
        path: str,
        requests: list[tuple[ReadItem, ItemLocation]],
        planner: LoadPlanner,
        size: int | None,
    ) -> None:
        """An object store: fetch what the items need in parallel ranged GETs, each streamed into
        the destination tensors themselves where they take the stored bytes as they are
        (:mod:`tierstore.dcp.object_read`); the other items are decoded from their own buffers."""
        assert self._tier is not None and self._checkpoint_id is not None
        tier, full = self._tier, checkpoint_file(self._checkpoint_id, path)
        needed = sum(location.length for _, location in requests)
        size = tier.stat(full).size if size is None else size
        if needed <= _WHOLE_FILE_FRACTION * size:
            self._read_items(requests, planner)
            return
        # Items over the same stored bytes (one chunk resharded into several local shards) share
        # one span: the first in-place destination, else one buffer.
        same: dict[tuple[int, int], list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        for item, location in requests:
            same[(location.offset, location.length)].append((item, location))
        spans: list[tuple[int, memoryview]] = []
        checks: list[tuple[ItemLocation, memoryview]] = []
        in_place: list[tuple[ReadItem, torch.Tensor]] = []
        later: list[tuple[ReadItem, ItemLocation, memoryview]] = []
        for (offset, length), group in sorted(same.items()):
            targets = [in_place_target(item, location, planner) for item, location in group]
            found = [(i, target) for i, target in enumerate(targets) if target is not None]
            lead = found[0][0] if found else None
            if found:
                data = memory_of(found[0][1])
                in_place.append((group[found[0][0]][0], found[0][1]))
            else:
                data = memoryview(bytearray(length))
            later += [
                (item, location, data) for i, (item, location) in enumerate(group) if i != lead
            ]
            spans.append((offset, data))
            checks.append((group[0][1], data))
        try:
            cut = pieces(spans, max(tier.capabilities.transfer_chunk, 2**20))
        except ValueError:  # items partly over the same bytes: not a layout tierstore writes
            self._read_items(requests, planner)
            return
        with ThreadPoolExecutor(
            max(1, tier.capabilities.transfer_streams), thread_name_prefix="tierstore-get"
        ) as pool:
            list(pool.map(lambda p: tier.read_scattered(full, p.offset, p.outs), cut))
        self._count(sum(length for _, length in same))
        for location, data in checks:  # S3 sends no checksum for a range: ours, before use
            if not is_intact(location, data):
                logger.warning("tier %s: %s: bytes %d..%d do not match their CRC32C: reading"
                               " them again", tier.name, full, location.offset,
                               location.offset + location.length)  # fmt: skip
                self._read_checked(full, location, data, attempts=ATTEMPTS - 1)
        for item, location, data in later:  # before any commit: a planner may move the data
            self._deliver(item, location, data, planner)
        for item, target in in_place:
            planner.commit_tensor(item, target)

    def _read_in_place(
        self, tier: Tier, full: str, item: ReadItem, location: ItemLocation, planner: LoadPlanner
    ) -> bool:
        """``preadv`` straight into the destination when it is exactly the stored chunk."""
        if not tier.capabilities.local_files:
            return False
        target = in_place_target(item, location, planner)
        if target is None:
            return False
        if location.length:
            self._read_checked(full, location, memory_of(target))
            self._count(location.length)
        planner.commit_tensor(item, target)
        return True


def _balanced(
    requests: list[tuple[ReadItem, ItemLocation]], parts: int
) -> list[list[tuple[ReadItem, ItemLocation]]]:
    """Split requests (kept in file order) into up to ``parts`` runs of about equal bytes."""
    total = sum(location.length for _, location in requests)
    batches: list[list[tuple[ReadItem, ItemLocation]]] = [[]]
    share, filled = max(1, total // parts), 0
    for request in requests:
        if filled >= share and len(batches) < parts:
            batches.append([])
            filled = 0
        batches[-1].append(request)
        filled += request[1].length
    return [b for b in batches if b]


def _copy_into(planner: LoadPlanner, item: ReadItem, stored: torch.Tensor) -> None:
    source = stored
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        if length < stored.size(dim):
            source = source.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise IntegrityError(
            f"{item.storage_index.fqn}: stored chunk {tuple(source.size())} does not fit"
            f" {tuple(target.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(item, target)


def _check_item_locations(metadata: Metadata, manifest: Manifest, where: str) -> None:
    """Every item ``.metadata`` locates lies inside a file the marker names, within its size.

    ``.metadata`` is input like any other: an item path that leaves the checkpoint (``../``, an
    absolute path, another generation's or another id's file) would make the load read whatever it
    names into the caller's tensors. The marker is the authority on what the copy holds.
    """
    sizes = {f.path: f.size for f in manifest.files}
    for index, location in (metadata.storage_data or {}).items():
        if not isinstance(location, ItemLocation):
            raise IntegrityError(f"{where}: item {index} has no tierstore location")
        size = sizes.get(location.path)
        if size is None:
            raise IntegrityError(
                f"{where}: item {index} is located in {location.path!r}, a file the commit marker"
                " does not name: refused"
            )
        if location.offset < 0 or location.length < 0 or location.offset + location.length > size:
            raise IntegrityError(
                f"{where}: item {index} spans bytes {location.offset}..{location.offset + location.length}"
                f" of {location.path!r}, which the marker says holds {size}: refused"
            )
