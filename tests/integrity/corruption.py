"""Corruption injected into one tier's committed copy of a checkpoint (issue 24, item 5).

Every kind damages the copy through the :class:`~tierstore.tiers.Tier` verbs only, so the same
injection works on a memory, local or S3 tier, and says which tier-relative path it damaged: the
path a restore's warning, an error and ``tierstore verify`` must name. A kind that picks a byte
takes it from a :class:`random.Random` seeded by the caller (the tests print the seed).

:class:`Snapshot` puts every tier back as it was, so many cases can share one costly set-up.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import boto3

from tests.local_files import real_path
from tierstore.ids import checkpoint_file, is_metadata_file, marker_path
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.tiers.s3.tier import S3Tier


@dataclass(frozen=True)
class Foreign:
    """Markers a damaged tier may be handed instead of its own (bytes as another tier held them)."""

    other_namespace: bytes
    """The same id's marker from another run (another namespace over the same tier roots)."""
    other_generation: bytes
    """The same id's marker of a generation an overwrite replaced (its data is gone)."""
    other_id: str
    """An id whose marker in the same tier is copied over the damaged id's."""


@dataclass(frozen=True)
class Injected:
    """What :func:`inject` did: the kind, the tier and the tier-relative path it damaged."""

    kind: str
    tier: str
    path: str


def _data_file(tier: Tier, checkpoint_id: str) -> str:
    """The largest data file of the copy (rank 0's tensors)."""
    files = read_manifest(tier, checkpoint_id, trust=MarkerTrust()).files
    entry = max((f for f in files if f.rank is not None), key=lambda f: f.size)
    return checkpoint_file(checkpoint_id, entry.path)


def _metadata_file(tier: Tier, checkpoint_id: str) -> str:
    files = read_manifest(tier, checkpoint_id, trust=MarkerTrust()).files
    return checkpoint_file(checkpoint_id, next(f.path for f in files if is_metadata_file(f.path)))


def _marker(_tier: Tier, checkpoint_id: str) -> str:
    return marker_path(checkpoint_id)


Damage = Callable[[Tier, str, Foreign, random.Random], None]
"""``(tier, tier-relative path, foreign markers, rng)``: damage one file."""


def _truncate(tier: Tier, path: str, _foreign: Foreign, rng: random.Random) -> None:
    raw = tier.read_bytes(path)
    tier.write_bytes(path, raw[: rng.randrange(len(raw))])


def _flip_one_bit(tier: Tier, path: str, _foreign: Foreign, rng: random.Random) -> None:
    raw = bytearray(tier.read_bytes(path))
    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    tier.write_bytes(path, bytes(raw))


def _delete(tier: Tier, path: str, _foreign: Foreign, _rng: random.Random) -> None:
    tier.delete(path)


def _cut_short(tier: Tier, path: str, _foreign: Foreign, rng: random.Random) -> None:
    raw = tier.read_bytes(path)  # never whole: a JSON object cut before its last brace
    tier.publish(path, raw[: rng.randrange(1, len(raw) - 1)], create_only=False)


def _replaced(by: Callable[[Tier, Foreign], bytes]) -> Damage:
    def damage(tier: Tier, path: str, foreign: Foreign, _rng: random.Random) -> None:
        tier.publish(path, by(tier, foreign), create_only=False)

    return damage


KINDS: dict[str, tuple[str, Callable[[Tier, str], str], Damage]] = {
    "truncate-data": ("a data file cut short", _data_file, _truncate),
    "flip-data": ("one bit flipped in a data file", _data_file, _flip_one_bit),
    "flip-metadata": ("one bit flipped in DCP's .metadata", _metadata_file, _flip_one_bit),
    "delete-shard": ("a data file deleted", _data_file, _delete),
    "delete-marker": ("the commit marker deleted", _marker, _delete),
    "malformed-marker": ("the commit marker cut short (malformed JSON)", _marker, _cut_short),
    "empty-marker": ("the commit marker cut to zero bytes", _marker, _replaced(lambda _tier, _foreign: b"")),
    "marker-other-run": (
        "the marker of the same id from another run (namespace)",
        _marker,
        _replaced(lambda _tier, foreign: foreign.other_namespace),
    ),
    "marker-other-generation": (
        "the marker of a generation an overwrite replaced",
        _marker,
        _replaced(lambda _tier, foreign: foreign.other_generation),
    ),
    "marker-other-id": (
        "the marker of another checkpoint id",
        _marker,
        _replaced(lambda tier, foreign: tier.read_bytes(marker_path(foreign.other_id))),
    ),
}
"""Every kind of corruption: ``{kind: (what it does, the file it picks, what it does to it)}``."""


def inject(tier: Tier, checkpoint_id: str, kind: str, foreign: Foreign, seed: int) -> Injected:
    """Damage ``tier``'s copy of ``checkpoint_id`` the way ``kind`` says (see :data:`KINDS`)."""
    _what, pick, damage = KINDS[kind]
    path = pick(tier, checkpoint_id)
    damage(tier, path, foreign, random.Random(seed))  # noqa: S311 - which byte, repeatably
    return Injected(kind, tier.name, path)


class Snapshot:
    """Every file of some tiers, to put them back exactly as they were (small checkpoints only).

    On tiers with local files the directories count too: a directory left behind (by a promotion
    whose files were deleted again) would be one more thing a listing finds. An S3 tier's objects
    are compared by the MD5 S3 lists as each one's ETag: one LIST per look instead of a GET per
    object (an object whose ETag is no MD5, a multipart one, is read).
    """

    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers = tiers
        self.files = [
            {f.path: tier.read_bytes(f.path) if f.size else b"" for f in tier.find("")} for tier in tiers
        ]
        self.digests = [{path: _md5(data) for path, data in files.items()} for files in self.files]
        self.dirs = [self._dirs(tier) for tier in tiers]
        self.clients: dict[str, Any] = {}
        """A boto3 client per S3 tier, made at its first look."""

    def _digests(self, tier: Tier) -> dict[str, str]:
        """``path -> MD5 (hex)`` of every file of ``tier`` now."""
        if not isinstance(tier, S3Tier):
            return {f.path: _md5(tier.read_bytes(f.path) if f.size else b"") for f in tier.find("")}
        if tier.name not in self.clients:
            self.clients[tier.name] = boto3.client("s3", endpoint_url=tier.config.endpoint_url)
        client = self.clients[tier.name]
        prefix = f"{tier.prefix}/" if tier.prefix else ""
        found: dict[str, str] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=tier.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith("/"):  # a folder placeholder: not a file (as Tier.find)
                    continue
                path, etag = item["Key"][len(prefix) :], item["ETag"].strip('"')
                found[path] = etag if "-" not in etag else _md5(tier.read_bytes(path))
        return found

    @staticmethod
    def _dirs(tier: Tier) -> set[str]:
        root = real_path(tier)
        return set() if root is None else {where for where, _d, _f in os.walk(root)}

    def restore(self) -> None:
        """Delete what was added, write back what was changed or removed."""
        for tier, files, digests, dirs in zip(self.tiers, self.files, self.digests, self.dirs, strict=True):
            now = self._digests(tier)
            for path in now.keys() - files.keys():
                tier.delete(path)
            for path, data in files.items():
                if now.get(path) != digests[path]:
                    tier.write_bytes(path, data)
            for added in sorted(self._dirs(tier) - dirs, reverse=True):  # deepest first
                os.rmdir(added)

    def differences(self) -> list[str]:
        """``tier: path`` of every file or directory that differs from the snapshot."""
        found = []
        for tier, digests, dirs in zip(self.tiers, self.digests, self.dirs, strict=True):
            now = self._digests(tier)
            found += [f"{tier.name}: {p}" for p in sorted(now.keys() ^ digests.keys())]
            found += [f"{tier.name}: {p}" for p in sorted(digests) if p in now and now[p] != digests[p]]
            found += [f"{tier.name}: {p}/" for p in sorted(self._dirs(tier) ^ dirs)]
        return found


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # noqa: S324 - what S3 lists as a whole object's ETag
