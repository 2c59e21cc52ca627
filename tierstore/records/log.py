"""The commit log: a monotonic sequence per namespace, the only thing that decides what is newest.

Every commit takes the next sequence number above the highest its writer knows, claimed create-only
in the target tier as ``<seq>~void``, then named by ``.tierstore/commits/<seq>~<id>~<generation>`` (an
empty object; :func:`tierstore.records.protocol.claim`). The entry travels with the copy: a promotion
writes it in its target, a drop deletes it. One listing of the directory orders every commit in a
tier, without reading a marker. Why a log and not the step or a clock, and what the head record
(:class:`Head`, a hint readers list above; never trusted for order) promises: docs/design.md, "The
rules that hold" (2) and "Layout inside a tier".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from tierstore.ids import (
    COMMITS_DIR,
    HEAD_PATH,
    commit_entry_path,
    commit_entry_prefix,
    parse_commit_entry,
    parse_void_entry,
)
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogEntry:
    """One commit: its sequence number, checkpoint id and generation, and the entry's path."""

    seq: int
    checkpoint_id: str
    generation: str

    @property
    def path(self) -> str:
        """Tier-relative path of the entry."""
        return commit_entry_path(self.seq, self.checkpoint_id, self.generation)


def read_log(tier: Tier) -> list[LogEntry]:
    """Every entry in ``tier``'s commit log that names a commit (one listing), in sequence order."""
    return read_log_and_voids(tier)[0]


_LONGER_SORT_LOWER = 10**11
"""From this number on, a name padded to 12 digits starts with a digit other than 0, and a longer
number's name (13 digits and more: ``1…``) may sort before it: the log is then listed whole."""


def read_log_and_voids(tier: Tier, *, above: int = 0) -> tuple[list[LogEntry], list[int]]:
    """The log's entries naming commits, and the numbers of its void entries (numbers taken by no
    commit that stands: see :func:`tierstore.ids.void_entry_path`), both in sequence order.

    ``above``: only the entries numbered higher (the numbers are zero-padded, so they sort as
    names: a store that lists in key order starts there: :meth:`~tierstore.tiers.Tier.find`'s ``after``).
    """
    entries, voids = [], []
    whole = above <= 0 or above + 1 >= _LONGER_SORT_LOWER
    for info in tier.find(COMMITS_DIR, after=None if whole else commit_entry_prefix(above + 1)):
        parsed = parse_commit_entry(info.path)
        if parsed is not None:
            entries.append(LogEntry(*parsed))
        elif (void := parse_void_entry(info.path)) is not None:
            voids.append(void)
    return sorted(entries, key=lambda e: e.seq), sorted(voids)


def highest_taken(tier: Tier) -> int:
    """:func:`highest_in` ``tier``, listing its log only above its head record's number (a number
    taken there, so never above the answer): one page at any retained count, not one per thousand
    commits. Without a head record (or a damaged one), the whole log."""
    head = read_head(tier)
    return highest_in(tier, above=0 if head is None else head.seq)


def highest_in(tier: Tier, *, above: int = 0) -> int:
    """The highest commit number taken in ``tier``, by a commit or a void entry, or ``above`` when
    none is higher (0 when none). ``above`` is a number the caller knows: only the log after it is
    listed, so a save's look at the log does not grow with what is retained."""
    log, voids = read_log_and_voids(tier, above=above)
    return max([above, log[-1].seq if log else 0, *voids])


HEAD_FORMAT = "tierstore.head/1"


@dataclass(frozen=True)
class Head:
    """A tier's head record: a number at or below the log's highest when it was written (a hint,
    see the module docstring), and whether every marker in the tier had its log entry when the
    record was first written (``logged``): then only a crash between a promotion's marker and its
    entry leaves a marker the log does not name. ``logged`` False (a tier written before the log,
    tierstore 0.1.0, or found with such a marker): readers list the whole tier as before."""

    seq: int
    logged: bool

    def encode(self) -> bytes:
        """The record's bytes (JSON)."""
        return json.dumps({"format": HEAD_FORMAT, "seq": self.seq, "logged": self.logged}).encode()


def read_head(tier: Tier) -> Head | None:
    """``tier``'s head record; None when it has none or it cannot be parsed (a reader then lists
    the whole log). Raises what the tier raises when it cannot be read (an unreachable tier)."""
    try:
        found = json.loads(tier.read_bytes(HEAD_PATH))
    except FileNotFoundError:
        return None
    except ValueError:
        logger.warning("tier %s: its head record is damaged; the log is listed whole", tier.describe())
        return None
    if not isinstance(found, dict) or found.get("format") != HEAD_FORMAT:
        return None
    seq, logged = found.get("seq"), found.get("logged")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or not isinstance(logged, bool):
        return None
    return Head(seq, logged)
