"""A restore's first step: the collective tier choice, then DCP's ``.metadata`` from that tier.

Every rank runs the same iterations of :func:`tierstore.dcp.restore.choice.choose_copy`; one rank
reads ``.metadata``, checks it against the commit marker (CRC32C, and the signed SHA-256 when there
is one) and broadcasts it, so every rank skips the same unusable tiers. Every item location is
checked against the files the marker names before anything is read.

The bytes are unpickled with an allowlist (:func:`load_metadata`): DCP's plain ``pickle.load`` would
run a crafted file's code on every ``dcp.load``. It admits DCP's own metadata classes, torch's
``Size``/``dtype``/``layout``/``memory_format`` values, tierstore's storage records and a few
builtins; anything else is refused with an error naming the global it tried to load.
"""

from __future__ import annotations

import io
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tierstore.checksum import crc32c, sha256_hex
from tierstore.dcp.collectives import broadcast_object, rank_and_world
from tierstore.dcp.layout import ItemLocation
from tierstore.dcp.mirror import job_groups
from tierstore.dcp.restore.choice import Choice, choose_copy
from tierstore.dcp.restore.session import RestoreSession, logger
from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file, is_metadata_file
from tierstore.records.marker import Manifest, entry_problem
from tierstore.records.sightings import trust_period
from tierstore.tiers import Tier


def read_metadata(session: RestoreSession) -> Metadata:
    """Choose the tier (collectively) and return DCP's metadata from it; on failure every
    ``read`` record is released."""
    mirrored = [m for t in session.tiers if (m := session.config.mirror_of(t.name)) is not None]
    if mirrored and session.collective:  # every rank reads metadata; created once per job
        job_groups(mirrored[0].timeout)
    try:
        return _choose_and_read(session)
    except BaseException:
        session.stop_reading()
        raise


def _choose_and_read(session: RestoreSession) -> Metadata:
    tiers, checkpoint_id = session.tiers, session.checkpoint_id
    excluded: dict[int, str] = {}
    while True:  # every rank runs the same iterations: each step's outcome is broadcast
        choice = choose_copy(
            tiers,
            checkpoint_id,
            trust=session.trust,
            mirrored=session.config.mirrored,
            node=session.node,
            verify=session.verify,
            group=session.process_group,
            excluded=excluded,
            prober=session.prober,
            before_probe=session.hold,
            sighting_trust=trust_period(session.config.promote.interval),
            collective=session.collective,
        )
        tier, manifest = tiers[choice.tier_index], choice.manifest
        session.choice = choice
        blob, where = _fetch(session, tier, manifest)
        if isinstance(blob, bytes):
            break
        logger.warning("restore of %s: skipping tier %s: %s", checkpoint_id, tier.name, blob)
        excluded[choice.tier_index] = blob
    metadata = load_metadata(blob, where=where)
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"{where}: not DCP metadata")
    check_item_locations(metadata, manifest, where)
    session.tier = tier
    if rank_and_world(session.process_group)[0] == 0:
        logger.info(
            "restore of %s: from tier %s (commit %s, generation %s), the fastest with a usable copy",
            checkpoint_id,
            tier.name,
            manifest.seq,
            manifest.generation,
        )
    session.stop_reading(keep=tier.name)  # other tiers may trim this id again
    session.storage = dict(metadata.storage_data or {})
    metadata.storage_meta = metadata.storage_meta or StorageMeta()
    metadata.storage_meta.load_id = uuid.uuid4().hex
    return metadata


def _fetch(session: RestoreSession, tier: Tier, manifest: Manifest) -> tuple[bytes | str, str]:
    """One rank reads ``.metadata`` and checks it against the marker; shared by broadcast.

    Returns the bytes, or a string saying why they are unusable.
    """
    entry = next((f for f in manifest.files if is_metadata_file(f.path)), None)
    if entry is None:
        return f"the marker of {session.checkpoint_id} names no .metadata file", tier.name
    path = checkpoint_file(manifest.checkpoint_id, entry.path)
    where = f"tier {tier.name}: {path}"
    rank, _ = rank_and_world(session.process_group)
    source = _metadata_rank(session.choice, entry.path)
    blob: bytes | str = b""
    if rank == source:
        try:
            path = session.stored(entry.path)
            blob = tier.read_bytes(path)
            session.count(len(blob))
            # Checked before anything unpickles it: a signed marker's SHA-256 too.
            sha = sha256_hex(blob) if entry.sha256 is not None else None
            blob = entry_problem(path, entry, len(blob), crc32c(blob), sha) or blob
        except Exception as exc:  # noqa: BLE001 - shared with every rank, then acted on
            blob = f"{path}: {exc}"
    return broadcast_object(blob, session.process_group, src=source), where


def _metadata_rank(choice: Choice | None, rel: str) -> int:
    """The rank that reads ``.metadata``: rank 0, or in a mirrored memory tier the first rank
    on a node that holds it (own or mirrored; the coordinator's node may be gone)."""
    if choice is None or choice.holdings is None:
        return 0
    return next(r for r, node in enumerate(choice.rank_nodes) if rel in choice.holdings.get(node, {}))


def check_item_locations(metadata: Metadata, manifest: Manifest, where: str) -> None:
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


_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_ALLOWED = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
}


_STORAGE_RECORDS = {
    ("tierstore.dcp.layout", "ItemLocation"): ItemLocation,
    # Written by tierstore 0.1.0, before the DCP face moved into tierstore.dcp: same class.
    ("tierstore.serialize", "ItemLocation"): ItemLocation,
}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STORAGE_RECORDS:
            return _STORAGE_RECORDS[(module, name)]
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_metadata(data: bytes, *, where: str) -> Any:
    """Unpickle DCP metadata from ``data``; :class:`IntegrityError` naming ``where`` if refused."""
    try:
        return _AllowlistUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
        raise IntegrityError(f"{where}: cannot load DCP metadata ({exc})") from None
