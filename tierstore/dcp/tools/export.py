"""``export_checkpoint``: a committed checkpoint as a plain DCP directory for torch's own reader.

The copy comes from the fastest tier holding a usable committed copy, chosen as a restore chooses it
(:func:`~tierstore.dcp.restore.choice.choose_copy`, for this process alone), or from the one tier
named; a copy found unreadable while it is converted gives way to the next usable tier. tierstore's
data files hold raw tensor bytes at aligned offsets (:class:`ItemLocation`), torch's ``torch.save``
records (:mod:`tierstore.dcp.tools.torch_files`): each source file is read once, front to back,
checked as it streams (:mod:`tierstore.dcp.tools.verified_read`), and re-encoded one item at a time.
Everything is written into a temporary sibling and renamed into place last; a ``read`` activity record
holds the source meanwhile. The contract: docs/operations.md, "Exporting a checkpoint to a plain DCP
directory".
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from tierstore._platform.progress import ByteProgress
from tierstore.checksum import crc32c, sha256_hex
from tierstore.config import Config, as_config
from tierstore.dcp.arguments import check_export_destination
from tierstore.dcp.layout import ItemLocation, decode_tensor
from tierstore.dcp.mirror import OWN, stored_path
from tierstore.dcp.restore import Choice, choose_copy, load_metadata
from tierstore.dcp.tools.torch_files import TorchDataFile, fsync_dir, write_metadata
from tierstore.dcp.tools.verified_read import VerifiedReader
from tierstore.errors import CheckpointNotFoundError, IntegrityError, TierUnavailableError
from tierstore.ids import is_metadata_file, validate_checkpoint_id
from tierstore.records.activity import Activity, hold
from tierstore.records.marker import FileEntry, Manifest, entry_problem
from tierstore.tiers import Tier
from tierstore.topology import current_node

logger = logging.getLogger(__name__)
Items = dict[ItemLocation, list[MetadataIndex]]
_SOURCE_FAILURES = (IntegrityError, FileNotFoundError, TierUnavailableError)
"""What reading a chosen copy may raise that the next tier's copy may not have: the export then
falls back to it (a failure writing the destination is not among them)."""


@dataclass(frozen=True)
class _Source:
    """The copy an export reads: its tier, its marker, and where each file the marker names is
    stored in that tier (a mirrored memory tier holds some files as mirrors, elsewhere)."""

    tier: Tier
    manifest: Manifest
    stored: dict[str, str]
    """Marker path (``<generation>/<name>``) -> tier-relative path to read it from."""

    def path(self, entry: FileEntry) -> str:
        """Tier-relative path of the stored copy of ``entry``."""
        return self.stored[entry.path]


def _source_of(tiers: list[Tier], choice: Choice, node: int) -> _Source:
    """The chosen copy, with a mirrored memory tier's files located on this node: own copies at
    their owner paths, the partner's at their mirror paths (the choice verified both)."""
    held = (choice.holdings or {}).get(node, {})
    ckpt = choice.manifest.checkpoint_id
    stored = {f.path: stored_path(ckpt, f.path, held.get(f.path, OWN)) for f in choice.manifest.files}
    return _Source(tiers[choice.tier_index], choice.manifest, stored)


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_checkpoint` wrote: ``files`` and ``bytes`` in ``destination``, from
    ``tier``'s copy (``generation``) of ``checkpoint_id``, ``items`` DCP items, in ``seconds``."""

    checkpoint_id: str
    tier: str
    generation: str
    destination: str
    files: int
    bytes: int
    items: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``id``, ``tier``, ``generation``, ``to``, ``files``, ``bytes``,
        ``items``, ``seconds``."""
        return {
            "id": self.checkpoint_id,
            "tier": self.tier,
            "generation": self.generation,
            "to": self.destination,
            "files": self.files,
            "bytes": self.bytes,
            "items": self.items,
            "seconds": round(self.seconds, 3),
        }


def export_checkpoint(
    config: Config | str | os.PathLike[str],
    checkpoint_id: str,
    dest: str | os.PathLike[str],
    *,
    tier: str | None = None,
    node: int | None = None,
    show_progress: bool = False,
) -> ExportReport:
    """Write committed checkpoint ``checkpoint_id`` to the new directory ``dest`` in torch's format.

    Args:
        config: a loaded :class:`~tierstore.config.Config` or the path of a YAML file.
        checkpoint_id: the checkpoint to export.
        dest: the directory to create; it may exist only as an empty directory. Its parent is
            created if missing.
        tier: export from this tier only (default: the fastest with a usable committed copy).
        node: this process's node index for node-local tiers (default: :func:`current_node`).
        show_progress: a bar on standard error while the bytes are converted, if it is a terminal
            (``tierstore restore``); never in logs or pipes.

    Raises:
        InvalidCheckpointIdError: ``checkpoint_id`` is not a valid id.
        ConfigError: ``tier`` names no configured tier.
        FileExistsError: ``dest`` exists and is not an empty directory.
        CheckpointNotFoundError: no tier searched holds a usable committed copy; the message lists
            every tier and why.
        IntegrityError: a source file does not match its marker (names tier, file, expected and
            actual size or CRC32C). Nothing is left at ``dest``.
    """
    started = time.monotonic()
    config = as_config(config)
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    destination = Path(os.path.abspath(dest))
    check_export_destination(destination)
    node = current_node(node)
    if tier is not None:
        config.tier(tier)  # ConfigError naming the known tiers
    tiers = config.make_tiers(node=node)
    excluded = (
        {}
        if tier is None
        else {i: f"not the tier asked for ({tier})" for i, t in enumerate(tiers) if t.name != tier}
    )
    reading = _announce(
        [t for i, t in enumerate(tiers) if i not in excluded], checkpoint_id, config.promote.activity_ttl
    )
    try:
        source, (files, size, items) = _export_from_first_usable(
            config,
            tiers,
            checkpoint_id,
            destination,
            node=node,
            excluded=excluded,
            reading=reading,
            show_progress=show_progress,
        )
    finally:
        for activity in reading.values():
            activity.release()
    report = ExportReport(
        checkpoint_id=checkpoint_id,
        tier=source.tier.name,
        generation=source.manifest.generation,
        destination=str(destination),
        files=files,
        bytes=size,
        items=items,
        seconds=time.monotonic() - started,
    )
    logger.info(
        "exported %s from %s to %s: %d files, %d bytes",
        checkpoint_id,
        source.tier.name,
        destination,
        files,
        size,
    )
    return report


def _export_from_first_usable(
    config: Config,
    tiers: list[Tier],
    checkpoint_id: str,
    destination: Path,
    *,
    node: int,
    excluded: dict[int, str],
    reading: dict[str, Activity],
    show_progress: bool,
) -> tuple[_Source, tuple[int, int, int]]:
    """Export from the fastest usable copy; when reading it fails, from the next one.

    The choice checks sizes only (and mirror copies' CRC32C); the conversion verifies every byte,
    so a copy can still fail there. Each failed tier is excluded, with its reason, and the choice is
    made again: it then lists that reason among every tier's when no copy is left. A corrupt byte
    stays an :class:`IntegrityError` (the CLI's exit 1) even then, naming the other tiers too.
    """
    excluded = dict(excluded)
    mismatch: IntegrityError | None = None
    while True:
        try:
            choice = choose_copy(
                tiers,
                checkpoint_id,
                trust=config.marker_trust(),
                mirrored=config.mirrored,
                node=node,
                verify=False,  # sizes only here: the conversion verifies every byte it reads
                excluded=excluded,
                collective=False,
            )
        except CheckpointNotFoundError as exc:
            if mismatch is not None:
                raise IntegrityError(f"{mismatch}; and {exc}") from exc
            raise
        # The faster tiers were unusable: only the chosen and slower ones may still serve.
        for index in range(choice.tier_index):
            activity = reading.pop(tiers[index].name, None)
            if activity is not None:
                activity.release()
        source = _source_of(tiers, choice, node)
        label = f"restore {checkpoint_id} from {source.tier.name}"
        total = sum(f.size for f in source.manifest.files) if show_progress else 0
        try:
            with ByteProgress(label, total, enabled=show_progress) as bar:
                return source, _export_into(source, destination, bar)
        except _SOURCE_FAILURES as exc:
            if isinstance(exc, IntegrityError) and mismatch is None:
                mismatch = exc
            reason = f"reading its copy failed: {exc}".replace("\n", "; ")
            logger.warning(
                "export of %s: tier %s: %s; trying the next tier", checkpoint_id, source.tier.name, reason
            )
            excluded[choice.tier_index] = reason


def _announce(tiers: list[Tier], checkpoint_id: str, ttl: float) -> dict[str, Activity]:
    """Hold a ``read`` record in every candidate tier before choosing, as a restore does."""
    reading: dict[str, Activity] = {}
    for tier in tiers:
        try:
            reading[tier.name] = hold(tier, "read", checkpoint_id, None, ttl=ttl)
        except Exception as exc:  # noqa: BLE001 - the choice says whether the tier is usable
            logger.warning("could not announce the export of %s in %s: %s", checkpoint_id, tier.name, exc)
    return reading


def _export_into(source: _Source, destination: Path, bar: ByteProgress) -> tuple[int, int, int]:
    """Convert into a temporary sibling, then rename it to ``destination``: (files, bytes, items)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.parent / f".{destination.name}.export-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        result = _convert(source, temporary, destination, bar)
        fsync_dir(temporary)
        try:
            os.rename(temporary, destination)  # replaces an empty directory; never a full one
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(
                    f"{destination}: became non-empty during the export; nothing was written there"
                ) from None
            raise
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    fsync_dir(destination.parent)
    return result


def _convert(source: _Source, out: Path, destination: Path, bar: ByteProgress) -> tuple[int, int, int]:
    tier, manifest = source.tier, source.manifest
    metadata_entry = next((f for f in manifest.files if is_metadata_file(f.path)), None)
    if metadata_entry is None:
        raise IntegrityError(
            f"tier {tier.name}: the marker of {manifest.checkpoint_id} names no .metadata file"
        )
    metadata = _read_metadata(source, metadata_entry)
    bar.update(metadata_entry.size)
    per_file: dict[str, Items] = defaultdict(lambda: defaultdict(list))
    for index, location in (metadata.storage_data or {}).items():
        if not isinstance(location, ItemLocation):
            raise IntegrityError(f"tier {tier.name}: {index.fqn}: not a tierstore item location")
        per_file[location.path][location].append(index)
    data_files = [f for f in manifest.files if f is not metadata_entry]
    unknown = sorted(set(per_file) - {f.path for f in data_files})
    if unknown:
        raise IntegrityError(
            f"tier {tier.name}: .metadata of {manifest.checkpoint_id} names files its marker does"
            f" not: {', '.join(unknown)}"
        )
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files, size = 0, 0
    for entry in sorted(data_files, key=lambda f: f.path):
        items = per_file.get(entry.path, {})
        written = _convert_file(source, entry, items, out=out, storage=storage, bar=bar)
        if written is not None:
            files, size = files + 1, size + written
    metadata.storage_data = storage
    metadata.storage_meta = dataclasses.replace(
        metadata.storage_meta or StorageMeta(), checkpoint_id=str(destination), load_id=None
    )
    size += write_metadata(out, metadata)
    return files + 1, size, len(storage)


def _read_metadata(source: _Source, entry: FileEntry) -> Metadata:
    """DCP's metadata of the copy, checked against the marker, unpickled with an allowlist."""
    tier, path = source.tier, source.path(entry)
    blob = tier.read_bytes(path)
    sha = sha256_hex(blob) if entry.sha256 is not None else None
    problem = entry_problem(path, entry, len(blob), crc32c(blob), sha)
    if problem is not None:
        raise IntegrityError(f"tier {tier.name}: {problem}")
    metadata = load_metadata(blob, where=f"tier {tier.name}: {path}")
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"tier {tier.name}: {path}: not DCP metadata")
    return metadata


PROGRESS_CHUNK = 64 * 1024 * 1024
"""Bytes of an item read between two moves of the progress bar: one large tensor is one item,
and a bar moved per item would stand still for the whole of its read."""


def _convert_file(
    source: _Source,
    entry: FileEntry,
    items: Items,
    *,
    out: Path,
    storage: dict[MetadataIndex, _StorageInfo],
    bar: ByteProgress,
) -> int | None:
    """Verify one source file and write its items to a file of the same name (none if it has
    none); return the size written."""
    tier, path = source.tier, source.path(entry)
    target = TorchDataFile(out, entry.path.rsplit("/", 1)[-1]) if items else None
    scratch = bytearray(max((location.length for location in items), default=0))
    try:
        with VerifiedReader(tier, path, entry) as reader:
            for location in sorted(items, key=lambda item: item.offset):
                data = memoryview(scratch)[: location.length]  # written out before the next read
                for start in range(0, location.length, PROGRESS_CHUNK):
                    part = data[start : start + PROGRESS_CHUNK]
                    reader.read_into(location.offset + start, part)
                    bar.update(len(part))
                info = _append(target, location, data, where=f"tier {tier.name}: {path}")
                storage.update(dict.fromkeys(items[location], info))
            reader.finish()
        bar.update(entry.size - sum(location.length for location in items))
    except BaseException:
        if target is not None:
            target.discard()
        raise
    return None if target is None else target.close()


def _append(
    target: TorchDataFile | None, location: ItemLocation, data: memoryview, *, where: str
) -> _StorageInfo:
    assert target is not None
    if location.encoding == "raw":
        return target.add_tensor(decode_tensor(data, location))
    if location.encoding in ("bytes", "torch"):
        return target.add_bytes(data)  # a byte item, or a tensor already in torch.save form
    raise IntegrityError(f"{where}: unknown item encoding {location.encoding!r}")
