"""The writer's hand-off to the peer mirror (see docs/mirror.md): after a rank's write, its files
go to a partner node's memory in a background exchange (:mod:`tierstore.dcp.mirror.rounds`); the
coordinator's commit, or its failure, tells the exchange how the save ended."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from tierstore.dcp.mirror.groups import job_groups
from tierstore.dcp.mirror.rounds import ExchangeWaits, Round, SavedShare, worker_for
from tierstore.records.marker import FileEntry, Manifest
from tierstore.topology import current_host

if TYPE_CHECKING:
    from tierstore.dcp.writer import TieredWriter


def mirrors(writer: TieredWriter) -> bool:
    """True when this save's files go to a partner node's memory too (see docs/mirror.md)."""
    return writer.tier.mirror is not None and dist.is_initialized() and dist.get_world_size() > 1


def open_groups(writer: TieredWriter) -> None:
    """Every rank, at every save's set-up: the job's gloo groups, created once (collective), before
    anything can fail."""
    if mirrors(writer):
        assert writer.tier.mirror is not None
        job_groups(writer.tier.mirror.timeout)


def hand_to_mirror(writer: TieredWriter, generation: str, seq: int, files: list[FileEntry] | None) -> None:
    """Every rank after its write, even one whose write failed (``files`` None): submit the
    exchange of its share to this process's mirror worker."""
    assert writer._checkpoint_id is not None and writer.tier.mirror is not None
    share = SavedShare(
        writer._checkpoint_id,
        generation,
        seq,
        writer._rank,
        writer.node,
        current_host(),
        tuple(files or ()),
        files is not None,
        writer._is_coordinator,
    )
    keep = writer.config.policy(writer.tier_name).keep
    ttl = writer.config.promote.activity_ttl
    writer._round = Round(share, writer.tier, writer.tier.mirror, keep, ttl, ended_record=writer._handover)
    writer._handover = None  # one save per copy of the writer; said once
    worker_for(writer.tier).submit(writer._round)


def tell_mirror(mirror: Round, published: Manifest | None, exc: BaseException | None) -> None:
    """The coordinator's commit ended: committed when a marker names the generation (a failed
    publish may have happened after all), else failed, and the exchange removes the save's files
    on every node."""
    if published is not None:
        mirror.outcome.committed(published.to_json())
    else:
        mirror.outcome.failed(f"{type(exc).__name__}: {exc}")


def hand_over(writer: TieredWriter) -> str | None:
    """PROCESS mode, when DCP pickles the writer for its checkpoint process: the path of the
    record that process writes once this save's exchange has ended (see
    :class:`~tierstore.dcp.mirror.rounds.ExchangeWaits`). The records live outside the save's
    generation directory: an overwrite or retention that drops the generation meanwhile
    leaves the wait intact."""
    if writer.tier.mirror is None or not mirrors(writer):
        return None
    if writer._waits is None:
        writer._waits = ExchangeWaits(writer.tier)
    return writer._waits.handover()


def wait_mirrored(writer: TieredWriter, timeout: float | None) -> bool:
    """Wait until this process's exchanges of finished saves have ended, in this process and in
    DCP's checkpoint processes; False if ``timeout`` seconds passed first."""
    if writer.tier.mirror is None or not mirrors(writer):
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    if not worker_for(writer.tier).wait_idle(timeout):  # rounds run in this process
        return False
    if writer._waits is None:
        return True
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return writer._waits.wait(left)  # rounds run in DCP's checkpoint process


def end_exchanges(writer: TieredWriter) -> bool:
    """At close: wait for the exchanges (bounded by ``mirror.timeout``), then stop waiting for
    the checkpoint processes' records; False when an exchange was still running."""
    mirror = writer.tier.mirror
    ended = mirror is None or wait_mirrored(writer, mirror.timeout)
    if writer._waits is not None:
        writer._waits.close()
        writer._waits = None
    return ended
