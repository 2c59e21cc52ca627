"""A tier's change stamp: one small file, ``.tierstore/changes``, rewritten with a fresh random token
after every change tierstore makes to what a promoter lists there.

What a promoter lists in a tier (markers, the commit log, conflict records, and in node-local tiers
the part records and the directories they are in) is costly to list when many checkpoints are kept:
pages of a LIST per few hundred ids in S3, a ``stat`` per generation on a disk. The stamp lets a
promoter skip that when nothing changed: it reads the stamp (one GET, one open), and when it holds the
token it read *before* its previous listing of the tier, it reuses that listing
(:mod:`tierstore.promote.views`).

**Who stamps.** Every operation of the commit protocol that changes what is listed stamps the tier
after its change, whether it completed or raised part-way: :func:`~tierstore.records.protocol.claim`,
:func:`~tierstore.records.protocol.publish`, :func:`~tierstore.records.protocol.drop` (retention,
cleanup, ``tierstore drop``, a failed save), :func:`~tierstore.records.protocol.forget_entry`, part records
(:func:`~tierstore.records.parts.confirm_part`, a promotion's per-rank records), conflict records,
and cleanup's removals. Records a promoter does not list from its view (activity records, sightings,
promoter state, peer mirrors, clock probes) do not stamp: they are read afresh every pass.

**Why the order makes a reused listing safe.** Say a promoter read token ``A``, then listed the tier
(view ``V``), and reads ``A`` again at a later pass. Any change ``C`` that ``V`` does not show was not
complete when the listing started, hence completed after ``A`` was read; its actor stamps *after*
``C`` with a fresh token, and a stamp written after ``A`` was read replaces ``A`` for good (tokens are
random, never written twice; a later write wins on POSIX renames and S3 alike). So reading ``A`` again
means every change missing from ``V`` still has its stamp to come: its actor is between its change and
its stamp, exactly as if the promoter had listed a moment before that change. ``V`` is then a snapshot
of the past, which any listing already is by the time it is used; every destructive step reads its
own evidence again (see :mod:`tierstore.promote.views`). A stamp written *before* the change would
break this: the promoter could read it, list before the change, and reuse that listing for good.

**What it does not see.** A change made behind tierstore's back (an operator's ``aws s3 rm``, a
lifecycle rule, a tierstore release from before the stamp), or by an actor killed between its change
and its stamp, leaves the token as it was: a promoter sees it at its next full listing, at most
``promote.full_scan`` after its previous one (docs/configuration.md). A stamp that cannot be written
(the tier refuses writes) is logged and does not fail the change, which is seen the same way.
"""

from __future__ import annotations

import logging
import uuid

from tierstore.errors import TierstoreError
from tierstore.ids import CHANGES_PATH
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


def touch(tier: Tier) -> None:
    """Rewrite ``tier``'s change stamp with a fresh token: call *after* each change (see the module
    docstring). Never raises: a stamp that cannot be written leaves the change to the next full
    listing, with a warning."""
    try:
        tier.publish(CHANGES_PATH, uuid.uuid4().hex.encode(), create_only=False)
    except (TierstoreError, OSError) as exc:
        logger.warning(
            "cannot stamp the change in tier %s (its promoters see it at their next full listing): %s",
            tier.describe(),
            exc,
        )


def read_stamp(tier: Tier) -> bytes | None:
    """``tier``'s change token now (one read); None when the tier has none yet. Read it *before*
    listing what it covers. Raises what the tier raises (an unreachable tier)."""
    try:
        return tier.read_bytes(CHANGES_PATH)
    except FileNotFoundError:
        return None
