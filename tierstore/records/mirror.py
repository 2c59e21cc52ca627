"""Peer mirrors at rest: the mirror marker, the owner's status record, what a node holds, retention.

A node that holds its partner's files of a save keeps them in its own memory tier under
``.tierstore/mirror/<id>/<generation>/`` (the same ``<generation>/<name>`` paths the commit marker
names), with a copy of the commit marker, and DCP's ``.metadata`` when the partner is the
coordinator's node. The **mirror marker** (``mirror-node<owner>.json``) is written last, after every
file it names was received, verified against the owner's CRC32C and renamed into place: a mirror
exists only where its marker is. The owner node records whether its files reached a mirror
(``<id>/<generation>/mirror/node<owner>.json``): a failed mirror is reduced redundancy, never a failed
save. Moving the bytes is :mod:`tierstore.dcp.mirror`'s job; this module never imports torch.

An **exchange-end record** (``.tierstore/mirror-ended/<waiter>/<n>.json``) tells a trainer in
``AsyncCheckpointerType.PROCESS`` mode that the exchange of its ``n``-th handed-over save has ended
(however it ended): the exchange runs in DCP's checkpoint process, and the trainer's
``wait_mirrored``/``close`` wait for these records. They live outside the generation directories, so
an overwrite or retention that drops a generation cannot take them away. The waiting process owns its
``<waiter>`` directory (named and locked as a staging directory is, see :mod:`tierstore._platform.owners`),
deletes each record once seen and the directory when it closes or exits; cleanup removes the
directory of a process that is gone.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tierstore._platform.owners import LOCK_NAME
from tierstore.checksum import crc32c
from tierstore.errors import IntegrityError
from tierstore.ids import (
    INTERNAL_DIR,
    MIRROR_DIR,
    MIRROR_MARKER_PREFIX,
    is_checkpoint_id,
    is_generation,
    mirror_commit_path,
    mirror_id_dir,
    mirror_status_path,
)
from tierstore.records.marker import FileEntry, Manifest, dump_record, file_entry, load_record
from tierstore.tiers import Tier

logger = logging.getLogger(__name__)
MIRROR_FORMAT = "tierstore.mirror/1"
STATUS_FORMAT = "tierstore.mirror-status/1"
EXCHANGE_ENDS_DIR = f"{INTERNAL_DIR}/mirror-ended"
"""Tier-relative directory of the exchange-end records, one directory per waiting process."""


@dataclass(frozen=True)
class MirrorMarker:
    """One owner node's files of one generation, complete and verified in its holder's memory."""

    checkpoint_id: str
    generation: str
    owner_node: int
    holder_node: int
    ranks: tuple[int, ...]
    """The saved ranks whose files this mirror holds (restore finds shards by saved rank)."""
    files: tuple[FileEntry, ...]
    seq: int | None
    manifest_crc32c: int
    """CRC32C of the commit marker's bytes this mirror belongs to (a copy sits beside it)."""
    topology: Mapping[str, Any] = field(default_factory=dict)
    written_at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        """Serialize (CRCs as hex)."""
        body = asdict(self)
        body["manifest_crc32c"] = f"{self.manifest_crc32c:08x}"
        body["topology"] = dict(self.topology)
        return dump_record(MIRROR_FORMAT, body, self.files)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> MirrorMarker:
        """Parse and validate; :class:`IntegrityError` naming ``where`` if malformed."""
        try:
            body = load_record(MIRROR_FORMAT, data)
            checkpoint_id, generation = str(body["checkpoint_id"]), str(body["generation"])
            if not is_generation(generation):
                raise ValueError(f"bad generation {generation!r}")
            return cls(
                checkpoint_id=checkpoint_id,
                generation=generation,
                owner_node=int(body["owner_node"]),
                holder_node=int(body["holder_node"]),
                ranks=tuple(int(r) for r in body["ranks"]),
                files=tuple(file_entry(checkpoint_id, generation, f) for f in body["files"]),
                seq=None if body.get("seq") is None else int(body["seq"]),
                manifest_crc32c=int(str(body["manifest_crc32c"]), 16),
                topology=dict(body.get("topology") or {}),
                written_at=float(body.get("written_at", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: malformed mirror marker ({exc})") from None


@dataclass(frozen=True)
class MirrorStatus:
    """Whether an owner node's files of a save reached their mirror (kept on the owner's node)."""

    checkpoint_id: str
    generation: str
    owner_node: int
    holder_node: int | None
    mirrored: bool
    reason: str = ""
    at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        """Serialize."""
        return dump_record(STATUS_FORMAT, asdict(self), ())

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> MirrorStatus:
        """Parse; :class:`IntegrityError` naming ``where`` if malformed."""
        try:
            body = load_record(STATUS_FORMAT, data)
            holder = body.get("holder_node")
            return cls(
                str(body["checkpoint_id"]),
                str(body["generation"]),
                int(body["owner_node"]),
                None if holder is None else int(holder),
                bool(body["mirrored"]),
                str(body.get("reason", "")),
                float(body.get("at", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: malformed mirror status ({exc})") from None


def write_status(tier: Tier, status: MirrorStatus) -> None:
    """Record on the owner's node whether its files of a save reached a mirror."""
    path = mirror_status_path(status.checkpoint_id, status.generation, status.owner_node)
    tier.publish(path, status.to_json(), create_only=False)


def read_status(tier: Tier, checkpoint_id: str, generation: str, node: int) -> MirrorStatus | None:
    """The status record of ``node``'s files of a save, or None when there is none."""
    path = mirror_status_path(checkpoint_id, generation, node)
    try:
        return MirrorStatus.from_json(tier.read_bytes(path), where=f"tier {tier.name}: {path}")
    except FileNotFoundError:
        return None


def exchange_ends_dir(waiter: str) -> str:
    """Tier-relative directory of the exchange-end records one process waits for."""
    return f"{EXCHANGE_ENDS_DIR}/{waiter}"


def exchange_end_path(waiter: str, number: int) -> str:
    """Tier-relative path of the record that the exchange of ``waiter``'s ``number``-th handed-over
    save has ended."""
    return f"{exchange_ends_dir(waiter)}/{number:08d}.json"


def record_exchange_end(tier: Tier, path: str, checkpoint_id: str, generation: str) -> None:
    """Where an exchange ran: say it ended, for the process waiting for it. Written only while that
    process still holds its directory (its lock is there): one that closed or died waits for
    nothing, and a record written for it would be left behind."""
    if not tier.exists(f"{path.rsplit('/', 1)[0]}/{LOCK_NAME}"):
        return
    body = {"checkpoint_id": checkpoint_id, "generation": generation, "at": time.time()}
    tier.publish(path, json.dumps(body).encode(), create_only=False)


def exchange_ended(tier: Tier, path: str) -> bool:
    """For the waiting process: True, and the record deleted, once the exchange at ``path`` has
    ended."""
    if not tier.exists(path):
        return False
    tier.delete(path)
    return True


def remove_exchange_waits(tier: Tier, directory: str) -> None:
    """The waiting process's directory of exchange-end records, its lock file with it."""
    tier.delete_tree(directory)


def held_mirrors(tier: Tier, checkpoint_id: str) -> list[MirrorMarker]:
    """Every mirror of ``checkpoint_id`` this node holds (marker present and readable)."""
    found: list[MirrorMarker] = []
    for generation in tier.list_dir(mirror_id_dir(checkpoint_id)):
        if not is_generation(generation):
            continue
        for name in tier.list_dir(f"{mirror_id_dir(checkpoint_id)}/{generation}"):
            if not (name.startswith(MIRROR_MARKER_PREFIX) and name.endswith(".json")):
                continue
            path = f"{mirror_id_dir(checkpoint_id)}/{generation}/{name}"
            try:
                found.append(MirrorMarker.from_json(tier.read_bytes(path), where=path))
            except FileNotFoundError:
                continue  # retention removed it meanwhile
            except IntegrityError as exc:
                logger.warning("ignoring mirror marker %s: %s", path, exc)
    return found


def mirrored_commits(tier: Tier, checkpoint_id: str) -> list[bytes]:
    """The commit-marker copies this node holds for ``checkpoint_id``: one per held generation
    whose mirror marker is present and names the copy's CRC32C (a copy without a marker belongs to
    an incomplete mirror; one whose bytes changed is skipped, with a warning)."""
    expected: dict[str, set[int]] = {}
    for marker in held_mirrors(tier, checkpoint_id):
        expected.setdefault(marker.generation, set()).add(marker.manifest_crc32c)
    blobs: list[bytes] = []
    for generation, crcs in sorted(expected.items()):
        path = mirror_commit_path(checkpoint_id, generation)
        try:
            blob = tier.read_bytes(path)
        except FileNotFoundError:
            continue
        if crc32c(blob) not in crcs:
            logger.warning(
                "ignoring %s in %s: CRC32C %08x, its mirror marker says %s",
                path,
                tier.name,
                crc32c(blob),
                ", ".join(f"{c:08x}" for c in crcs),
            )
            continue
        blobs.append(blob)
    return blobs


def mirrored_ids(tier: Tier) -> dict[str, int | None]:
    """``{id: newest commit sequence}`` of every checkpoint this node holds a mirror of."""
    found: dict[str, int | None] = {}
    for checkpoint_id in tier.list_dir(MIRROR_DIR):
        if not is_checkpoint_id(checkpoint_id):
            continue
        seqs: list[int] = []
        held = False
        for blob in mirrored_commits(tier, checkpoint_id):
            try:
                seq = Manifest.from_json(blob, where=checkpoint_id).seq
            except IntegrityError:
                continue
            held = True
            seqs += [] if seq is None else [seq]
        if held:
            found[checkpoint_id] = max(seqs) if seqs else None
    return found


Recycle = Callable[[str, int], bool]
"""``recycle(path, size)``: take the file ``path`` (tier-relative, ``size`` bytes) of a dropped
mirror out of the mirror directory for reuse, True when it did (``Spares.recycle``)."""
