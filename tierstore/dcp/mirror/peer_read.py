"""Peer restore: a rank receives the files its node lacks from a node that holds them.

Runs inside ``dcp.load``'s ``read_data`` on every rank (DCP calls it on all of them), on the job's
restore group (:mod:`tierstore.dcp.mirror.groups`): the ranks all-gather which files each one needs
and does not hold on its node, every rank derives the same schedule (each file from a rank on a node
that holds it, spread over those ranks), and the files move point-to-point into memory, each checked
against the marker's CRC32C before a byte of it is used. Nothing slower than host memory is touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierstore.checksum import crc32c, sha256_hex
from tierstore.dcp.collectives import all_gather_object
from tierstore.dcp.layout import memory_of
from tierstore.dcp.mirror.inventory import Holdings, stored_path
from tierstore.dcp.mirror.transport import chunks, map_file, post_recv, post_send, wait_all
from tierstore.errors import IntegrityError
from tierstore.records.marker import Manifest
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerFetch:
    """One file a rank receives from another."""

    receiver: int
    sender: int
    path: str
    size: int
    crc: int
    first_tag: int


def schedule(
    wants: list[list[str]], manifest: Manifest, holdings: Holdings, rank_nodes: list[int]
) -> list[PeerFetch]:
    """Who sends what to whom: the same list on every rank."""
    entries = {f.path: f for f in manifest.files}
    fetches: list[PeerFetch] = []
    tag = 1
    for receiver, paths in enumerate(wants):
        for index, path in enumerate(paths):
            senders = [r for r, node in enumerate(rank_nodes) if path in holdings.get(node, {})]
            if not senders:
                raise IntegrityError(f"{path}: no live node holds it (the inventory said one did)")
            entry = entries[path]
            sender = senders[(receiver + index) % len(senders)]
            fetches.append(PeerFetch(receiver, sender, path, entry.size, entry.crc32c, tag))
            tag += max(1, chunks(entry.size))
    return fetches


def fetch_missing(
    tier: Tier,
    manifest: Manifest,
    holdings: Holdings,
    rank_nodes: list[int],
    needed: set[str],
    *,
    group: dist.ProcessGroup,
    timeout_s: float,
) -> dict[str, torch.Tensor]:
    """Every rank: receive the ``needed`` files this rank's node lacks, send what others lack.

    Returns ``{path: bytes as a uint8 tensor}`` of the files received, each verified.
    """
    me = dist.get_rank(group)
    mine = holdings.get(rank_nodes[me], {})
    wants: list[list[str]] = all_gather_object(sorted(needed - mine.keys()), group)
    fetches = schedule(wants, manifest, holdings, rank_nodes)
    received: dict[str, torch.Tensor] = {}
    works: list[dist.Work] = []
    kept: list[torch.Tensor] = []
    for fetch in fetches:
        if fetch.receiver == me:
            received[fetch.path] = torch.empty(fetch.size, dtype=torch.uint8)
            works += post_recv(received[fetch.path], fetch.sender, group, fetch.first_tag)
        if fetch.sender == me:
            path = stored_path(manifest.checkpoint_id, fetch.path, mine[fetch.path])
            data = map_file(tier, path, fetch.size)
            kept.append(data)
            works += post_send(data, fetch.receiver, group, fetch.first_tag)
    wait_all(works, timeout_s)
    entries = {f.path: f for f in manifest.files}
    for fetch in fetches:
        if fetch.receiver == me:
            view = memory_of(received[fetch.path])
            got = crc32c(view)
            if got != fetch.crc:
                raise IntegrityError(
                    f"{fetch.path} received from rank {fetch.sender}: CRC32C {got:08x}, the"
                    f" marker says {fetch.crc:08x}"
                )
            # A signed marker's SHA-256 too: these bytes may hold byte items DCP unpickles,
            # and a CRC32C can be forged (see the threat model).
            expected = entries[fetch.path].sha256
            if expected is not None and sha256_hex(view) != expected:
                raise IntegrityError(
                    f"{fetch.path} received from rank {fetch.sender}: its SHA-256 is not the one"
                    " the signed marker records; not loaded"
                )
    if received:
        logger.info(
            "restore of %s: received %d file(s), %d bytes, from peer ranks",
            manifest.checkpoint_id,
            len(received),
            sum(t.numel() for t in received.values()),
        )
    return received
