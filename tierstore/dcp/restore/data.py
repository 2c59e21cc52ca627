"""A restore's data read (DCP's ``read_data``): every item of a rank's plan from the chosen copy.

In order: files this node lacks in a mirrored memory tier come from peers; files whose items must be
checked whole before use (byte items of a signed checkpoint, items saved without a CRC32C of their
own) are read whole and checked against the marker; the rest is read item by item, each checked
against its CRC32C. POSIX tiers: tensors straight into their destinations by several threads at once
(``preadv`` copies in the kernel, so they run in parallel), byte items afterwards on this thread,
since loading them changes the caller's state dict. Object stores: object by object
(:mod:`tierstore.dcp.restore.objects`).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from tierstore.checksum import crc32c, sha256_hex
from tierstore.dcp.collectives import rank_and_world
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror import fetch_missing, job_groups
from tierstore.dcp.restore.items import Request, balanced, deliver, read_items
from tierstore.dcp.restore.objects import read_object
from tierstore.dcp.restore.session import RestoreSession, logger
from tierstore.errors import IntegrityError, TierstoreError
from tierstore.records.marker import entry_problem

_READ_WORKERS = max(2, min(8, os.cpu_count() or 2))


def read_data(session: RestoreSession, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
    """Read, check and deliver every item of ``plan``; the ``read`` records end with it."""
    tier = session.tier
    if tier is None:
        raise TierstoreError("read_data() before read_metadata()")
    requests = sorted(
        ((item, session.storage[item.storage_index]) for item in plan.items),
        key=lambda r: (r[1].path, r[1].offset),
    )
    try:
        requests = _serve_from_peers(session, requests, planner)
        if session.trust.keys is not None:  # byte items are unpickled: only from bytes checked on read
            _read_whole_files(
                session, [r for r in requests if r[0].type == LoadItemType.BYTE_IO], planner, signed=True
            )
            requests = [r for r in requests if r[0].type != LoadItemType.BYTE_IO]
        # Saved before items carried a CRC32C: their files are read whole and checked.
        _read_whole_files(session, [r for r in requests if r[1].crc is None], planner)
        requests = [r for r in requests if r[1].crc is not None]
        if tier.local is not None:
            _read_local(session, requests, planner)
        else:
            _read_objects(session, requests, planner)
    finally:  # the data is in memory: cleanup and retention may act on this id again
        session.stop_reading()
    if rank_and_world(session.process_group)[0] == 0:
        logger.info(
            "restored %s from tier %s: rank 0 read %d bytes, %.2f s since the load began",
            session.checkpoint_id,
            tier.name,
            session.bytes_read,
            time.monotonic() - session.began,
        )
    future: Future[None] = Future()
    future.set_result(None)
    return future


def _read_local(session: RestoreSession, requests: list[Request], planner: LoadPlanner) -> None:
    """A POSIX tier: tensors on several threads, then byte items on this one."""
    tensors = [r for r in requests if r[0].type != LoadItemType.BYTE_IO]
    with ThreadPoolExecutor(_READ_WORKERS, thread_name_prefix="tierstore-read") as pool:
        batches = balanced(tensors, _READ_WORKERS)
        list(pool.map(lambda batch: read_items(session, batch, planner), batches))
    read_items(session, [r for r in requests if r[0].type == LoadItemType.BYTE_IO], planner)


def _read_objects(session: RestoreSession, requests: list[Request], planner: LoadPlanner) -> None:
    """An object store: object by object."""
    per_file: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        per_file[request[1].path].append(request)
    # The sizes the marker records (checked when the copy was chosen): no HEAD each.
    manifest = session.choice.manifest if session.choice is not None else None
    sizes = {f.path: f.size for f in manifest.files} if manifest is not None else {}
    for path, file_requests in per_file.items():
        read_object(session, path, file_requests, planner, sizes.get(path))


def _read_whole_files(
    session: RestoreSession, requests: list[Request], planner: LoadPlanner, *, signed: bool = False
) -> None:
    """Each file holding some of ``requests`` is read whole, once, and checked against its
    marker entry before any of its items is delivered: byte items of a signed checkpoint
    (``signed``: DCP unpickles them, so the signed SHA-256 must match, a CRC32C can be
    forged), and items saved without a CRC32C of their own. A mismatch raises
    :class:`IntegrityError` naming tier and file."""
    tier, choice = session.tier, session.choice
    assert tier is not None and choice is not None
    entries = {f.path: f for f in choice.manifest.files}
    per_file: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        per_file[request[1].path].append(request)
    for rel, file_requests in per_file.items():
        full, entry = session.stored(rel), entries.get(rel)
        if entry is None:
            raise IntegrityError(f"tier {tier.name}: {full}: not named by the marker")
        blob = tier.read_bytes(full)
        session.count(len(blob))
        sha = sha256_hex(blob) if signed or entry.sha256 is not None else None
        problem = entry_problem(full, entry, len(blob), crc32c(blob), sha)
        if problem is not None or (signed and entry.sha256 is None):
            raise IntegrityError(f"tier {tier.name}: {problem or full + ': no SHA-256'}")
        for item, location in file_requests:
            data = memoryview(blob)[location.offset : location.offset + location.length]
            deliver(tier.name, item, location, data, planner)


def _serve_from_peers(
    session: RestoreSession, requests: list[Request], planner: LoadPlanner
) -> list[Request]:
    """Mirrored memory tier: receive the files this node lacks from peers (a collective every
    rank joins), load their items from memory; returns the requests left to read locally."""
    choice, tier = session.choice, session.tier
    mirror = None if tier is None else session.config.mirror_of(tier.name)
    if choice is None or choice.holdings is None or tier is None or mirror is None:
        return requests
    if not session.collective:
        return requests  # alone: no peer sends anything
    groups = job_groups(mirror.timeout)
    if groups is None:
        return requests
    received = fetch_missing(
        tier,
        choice.manifest,
        choice.holdings,
        choice.rank_nodes,
        {location.path for _, location in requests},
        group=groups.restore,
        timeout_s=mirror.timeout,
    )
    for item, location in requests:
        if location.path in received:
            whole = memory_of(received[location.path])
            part = whole[location.offset : location.offset + location.length]
            deliver(tier.name, item, location, part, planner)
    return [r for r in requests if r[1].path not in received]
