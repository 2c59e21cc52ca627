"""The writer's hand-off to the peer mirror (see docs/mirror.md): after a rank's write, its files
go to a partner node's memory in a background exchange (:mod:`tierstore.dcp.mirror.rounds`); the
coordinator's commit, or its failure, tells the exchange how the save ended."""

from __future__ import annotations

import time

import torch.distributed as dist

from tierstore.dcp.mirror import ExchangeWaits, Round, SavedShare, job_groups, worker_for
from tierstore.dcp.save.session import SaveSession
from tierstore.placement import MirrorConfig
from tierstore.records.marker import FileEntry, Manifest
from tierstore.tiers import Tier
from tierstore.topology import current_host


def mirrors(mirror: MirrorConfig | None) -> bool:
    """True when a save's files go to a partner node's memory too (see docs/mirror.md)."""
    return mirror is not None and dist.is_initialized() and dist.get_world_size() > 1


def open_groups(mirror: MirrorConfig | None) -> None:
    """Every rank, at every save's set-up: the job's gloo groups, created once (collective), before
    anything can fail."""
    if mirror is not None and mirrors(mirror):
        job_groups(mirror.timeout)


def hand_to_mirror(session: SaveSession, generation: str, seq: int, files: list[FileEntry] | None) -> None:
    """Every rank after its write, even one whose write failed (``files`` None): submit the
    exchange of its share to this process's mirror worker."""
    tier, mirror = session.tier, session.mirror
    assert mirror is not None
    share = SavedShare(
        session.checkpoint_id,
        generation,
        seq,
        session.rank,
        session.node,
        current_host(),
        tuple(files or ()),
        files is not None,
        session.is_coordinator,
    )
    keep = session.config.policy(session.tier_name).keep
    ttl = session.config.promote.activity_ttl
    session.round = Round(share, tier, mirror, keep, ttl, ended_record=session.handover)
    session.handover = None  # one save per copy of the writer; said once
    worker_for(tier).submit(session.round)


def tell_mirror(mirror: Round, published: Manifest | None, exc: BaseException | None) -> None:
    """The coordinator's commit ended: committed when a marker names the generation (a failed
    publish may have happened after all), else failed, and the exchange removes the save's files
    on every node."""
    if published is not None:
        mirror.outcome.committed(published.to_json())
    else:
        mirror.outcome.failed(f"{type(exc).__name__}: {exc}")


class MirrorWaits:
    """The trainer's waits for the exchanges of saves handed to DCP's checkpoint process (PROCESS
    mode), across saves (see :class:`~tierstore.dcp.mirror.rounds.ExchangeWaits`)."""

    def __init__(self, mirror: MirrorConfig | None) -> None:
        self.mirror = mirror
        self.waits: ExchangeWaits | None = None

    def hand_over(self, tier: Tier) -> str | None:
        """When DCP pickles the writer for its checkpoint process: the path of the record that
        process writes once this save's exchange has ended, outside the save's generation (an
        overwrite or retention dropping the generation meanwhile leaves the wait intact)."""
        if not mirrors(self.mirror):
            return None
        if self.waits is None:
            self.waits = ExchangeWaits(tier)
        return self.waits.handover()

    def wait(self, tier: Tier, timeout: float | None) -> bool:
        """Wait until this process's exchanges of finished saves have ended, in this process and
        in DCP's checkpoint processes; False if ``timeout`` seconds passed first."""
        if not mirrors(self.mirror):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not worker_for(tier).wait_idle(timeout):  # rounds run in this process
            return False
        if self.waits is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.waits.wait(left)  # rounds run in DCP's checkpoint process

    def end(self, tier: Tier) -> bool:
        """At close: wait for the exchanges (bounded by ``mirror.timeout``), then stop waiting for
        the checkpoint processes' records; False when an exchange was still running."""
        ended = self.mirror is None or self.wait(tier, self.mirror.timeout)
        if self.waits is not None:
            self.waits.close()
            self.waits = None
        return ended
