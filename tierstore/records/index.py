"""A job-wide tier's index, ``.tierstore/index.json``: its keeper's last listing of it, so that the
other nodes' promoters read one record instead of listing the tier.

Listing a tier that keeps 10,000 checkpoints costs pages of LIST requests; 1,250 nodes doing it after
every change is far more than a store serves. The keeper of a job-wide tier
(:mod:`tierstore.promote.keeper`) lists it anyway; after each fresh listing it writes what the
listing showed here, with the change stamp's token it read *before* that listing
(:mod:`tierstore.records.changes`). A node that reads the stamp and then finds the same token in the
index holds what a listing of its own made at that moment would show, or something newer: every
change missing from the index completed after the token was read, and its stamp, written after it,
would have replaced the token. A token that differs means the keeper has not indexed the latest
change yet: the reader waits for it (:mod:`tierstore.promote.view`).

A keeper's first listing of its tier (start-up, or after a takeover) takes each copy whose marker
shows the mtime the index records for it from the index instead of reading that marker
(``IndexedCopy.marker_mtime``): a first pass over 10,000 retained reads the markers changed since,
not 10,000.

When the job signs its markers (:mod:`tierstore.signing`), the keeper signs the index with the
job's key, and a reader with the job's keys takes only an index one of them signed: an index is
trusted for what the markers say (a watcher deletes its own copies of what it names), so a forged
one must not pass where a forged marker would not.

Best effort: an index that is absent, damaged, of another format or (signing on) not signed by an
accepted key is no index, and a reader lists the tier as before. Writing it does not stamp the tier
(a promoter does not list it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from dataclasses import asdict, dataclass
from typing import Any

from tierstore.ids import INDEX_PATH
from tierstore.records.conflicts import Conflict
from tierstore.signing import SigningKeys
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)

FORMAT = "tierstore.index/1"


@dataclass(frozen=True)
class IndexedCopy:
    """One committed copy in the tier: what its marker says that a promoter decides by."""

    checkpoint_id: str
    seq: int | None
    step: int | None
    committed_at: float
    generation: str
    source: str = ""
    """The tier it was promoted from (the marker's provenance; '' for a save's own commit)."""
    overwrite: bool | None = None
    unseen_tiers: tuple[str, ...] = ()
    started_at: float | None = None
    """When its save started (the marker's ``timings``), if it says."""
    marker_mtime: float | None = None
    """The mtime its marker was listed at, when the keeper that wrote this held the marker's content
    settled for that mtime (by the rules of :class:`~tierstore.promote.discovery.MarkerCache`): the
    next keeper that lists the same mtime takes this row for the marker and does not read it.
    None: read it (not settled, or an index written without it)."""


@dataclass(frozen=True)
class Index:
    """What the keeper's listing of the tier showed (see the module docstring)."""

    token: bytes | None
    """The change stamp read before that listing (None: the tier had none)."""
    highest: int
    """The highest number in the tier's commit log."""
    conflicts: tuple[Conflict, ...]
    copies: tuple[IndexedCopy, ...]


def encode(index: Index, keys: SigningKeys | None = None) -> bytes:
    """The record's bytes: JSON, one row per copy, compressed; with ``keys``, signed by the first
    (over :func:`_signed_body`)."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "token": None if index.token is None else index.token.hex(),
        "highest": index.highest,
        "conflicts": [asdict(c) for c in index.conflicts],
        "copies": [[*asdict(c).values()] for c in index.copies],
    }
    if keys is not None:
        body["signature"] = keys.sign(_signed_body(body))
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode())


def _signed_body(body: dict[str, Any]) -> bytes:
    """What an index's signature covers: every field but the signature, canonical JSON (the
    values JSON gives back unchanged: strings, integers, floats by their shortest repr)."""
    fields = {k: v for k, v in body.items() if k != "signature"}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def decode(blob: bytes, keys: SigningKeys | None = None) -> Index:
    """The index ``blob`` holds; ``ValueError`` when it is damaged, of another format, or (with
    ``keys``) not signed by one of them."""
    try:
        body = json.loads(zlib.decompress(blob))
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"expected format {FORMAT!r}")
        if keys is not None and not keys.accepts(_signed_body(body), body.get("signature")):
            raise ValueError(f"not signed by the key in {keys.key_env} or an accepted key")
        token = body["token"]
        rows = (IndexedCopy(*row) for row in body["copies"])
        copies = [dataclasses.replace(c, unseen_tiers=tuple(c.unseen_tiers)) for c in rows]
        return Index(
            None if token is None else bytes.fromhex(token),
            int(body["highest"]),
            tuple(Conflict(**c) for c in body["conflicts"]),
            tuple(copies),
        )
    except (zlib.error, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"damaged index: {exc}") from exc


def write_index(tier: Tier, index: Index, keys: SigningKeys | None = None) -> None:
    """Replace ``tier``'s index (its keeper only, fenced by its lease), signed with ``keys`` (the
    job's, when it signs markers). Raises what the tier raises."""
    tier.publish(INDEX_PATH, encode(index, keys), create_only=False)


def read_index(tier: Tier, keys: SigningKeys | None = None) -> Index | None:
    """``tier``'s index; None when there is none or it cannot be used (damaged, another format,
    with ``keys`` not signed by one of them: logged). Raises what the tier raises (an unreachable
    tier)."""
    try:
        blob = tier.read_bytes(INDEX_PATH)
    except FileNotFoundError:
        return None
    try:
        return decode(blob, keys)
    except ValueError as exc:  # json's and bytes.fromhex's errors are ValueErrors too
        logger.warning("ignoring the index of tier %s (it is listed instead): %s", tier.describe(), exc)
        return None
