"""The commit marker: a manifest of one checkpoint copy, published last, after every file it names.

A checkpoint exists in a tier only where its marker is (``<id>/commit.json``). The marker names every
file of the copy (data files and DCP's ``.metadata``) with its size and CRC32C, plus the world size, the
writer's version, the commit time, and the save's timings. A copy is *usable* when its marker parses
and every file it names is present at the named size (and, when verifying, has the named CRC32C).

When the job signs (:mod:`tierstore.signing`), every file entry also carries the file's SHA-256, and
the marker carries an HMAC over its *signed body* (:func:`signed_body`): the fields that say what the
content is, none that promotion changes, so the signature travels unchanged to every tier. A tier
with the job's keys reads only markers whose signature one of them makes (:func:`parse_marker`, given the
reader's :class:`~tierstore.signing.MarkerTrust`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tierstore.checksum import Digest
from tierstore.errors import IntegrityError
from tierstore.ids import checked_file_path, checkpoint_file, is_generation, marker_path, step_of
from tierstore.signing import MarkerTrust, SigningKeys
from tierstore.tiers.base import Tier
from tierstore.version import __version__

logger = logging.getLogger(__name__)
FORMAT = "tierstore.commit/1"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint copy, relative to the checkpoint's directory (``<gen>/<name>``)."""

    path: str
    size: int
    crc32c: int
    rank: int | None = None
    """The rank that wrote it (None for DCP's metadata, written by the coordinator)."""
    node: int = 0
    """The node whose node-local tiers hold it."""
    sha256: str | None = None
    """SHA-256 (64 hex digits), recorded when the job signs its markers; None otherwise."""


@dataclass(frozen=True)
class Manifest:
    """The content of a commit marker. Immutable; :meth:`to_json`/:meth:`from_json` round-trip."""

    checkpoint_id: str
    generation: str
    world_size: int
    files: tuple[FileEntry, ...]
    committed_at: float = field(default_factory=time.time)
    tierstore_version: str = __version__
    timings: Mapping[str, float | None] = field(default_factory=dict)
    seq: int | None = None
    """Commit order within the namespace (1, 2, ...); drives ``every`` (:mod:`tierstore.promote.policy`)."""
    provenance: Mapping[str, Any] | None = None
    """Of a promoted copy: the tier it came from and when it was committed there (JSON ``source``)."""
    topology: Mapping[str, Any] | None = None
    """The saving job's nodes (``{"hosts": {node: host}, "mirror_stride": s}``) when the memory tier
    mirrors: the peer placement is recomputed from it (:func:`tierstore.placement.place`)."""
    overwrite: bool | None = None
    """Whether the save asked to replace whatever the id held (``overwrite=True``); None in markers
    from before this field, which promotion treats as it always did (the newer commit replaces)."""
    unseen_tiers: tuple[str, ...] = ()
    """Tiers the save knew nothing of: unreachable when its process started, and never seen by the
    promoter since (:mod:`tierstore.records.known`). Promotion into one of them never replaces, nor
    is replaced by, another content of the id there: both are kept (a conflict)."""
    namespace: str | None = None
    """The namespace of the run that committed it (``""``: none); None in markers from before this
    field. A tier reads only markers of its own namespace (:func:`read_manifest`): one copied from
    another run under the same id names that run's files and commit number, not this run's."""
    signature: str | None = None
    """``hmac-sha256:<hex>`` over :func:`signed_body` when the job signs; None otherwise."""

    @property
    def step(self) -> int | None:
        """The step parsed from the id (see :func:`tierstore.ids.step_of`)."""
        return step_of(self.checkpoint_id)

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of every file."""
        return sum(f.size for f in self.files)

    @property
    def nodes(self) -> list[int]:
        """The nodes whose node-local tiers hold part of this copy."""
        return sorted({f.node for f in self.files})

    def with_changes(self, **changes: Any) -> Manifest:
        """A copy with some fields replaced (e.g. ``committed_at`` for a promoted copy)."""
        return replace(self, **changes)

    def to_json(self) -> bytes:
        """Serialize (UTF-8 JSON; CRCs as 8 hex digits)."""
        body = asdict(self)
        body["timings"] = dict(self.timings)
        body["source"] = body.pop("provenance")
        return dump_record(FORMAT, body, self.files)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate a marker; :class:`IntegrityError` naming ``where`` if it is malformed."""
        try:
            body = load_record(FORMAT, data)
            checkpoint_id = str(body["checkpoint_id"])
            generation = str(body["generation"])
            if not is_generation(generation):
                raise ValueError(f"bad generation {generation!r}")
            files = tuple(file_entry(checkpoint_id, generation, f) for f in body["files"])
            return cls(
                checkpoint_id=checkpoint_id,
                generation=generation,
                world_size=int(body["world_size"]),
                files=files,
                committed_at=float(body["committed_at"]),
                tierstore_version=str(body.get("tierstore_version", "?")),
                timings={str(k): v for k, v in dict(body.get("timings") or {}).items()},
                seq=None if body.get("seq") is None else int(body["seq"]),
                provenance=body.get("source"),
                topology=body.get("topology"),
                overwrite=None if body.get("overwrite") is None else bool(body["overwrite"]),
                unseen_tiers=tuple(str(t) for t in body.get("unseen_tiers") or ()),
                namespace=None if body.get("namespace") is None else str(body["namespace"]),
                signature=None if body.get("signature") is None else str(body["signature"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: malformed commit marker ({exc})") from None


def dump_record(format_: str, body: dict[str, Any], files: tuple[FileEntry, ...]) -> bytes:
    """A record's JSON bytes: ``format`` first, file entries with CRCs as 8 hex digits."""
    body["files"] = [_file_json(f) for f in files]
    return json.dumps({"format": format_, **body}, indent=1, sort_keys=True).encode()


def _file_json(f: FileEntry) -> dict[str, Any]:
    entry = {**asdict(f), "crc32c": f"{f.crc32c:08x}"}
    if f.sha256 is None:
        del entry["sha256"]  # unsigned jobs write the records they always wrote
    return entry


SIGNED_FORMAT = "tierstore.signed/1"


def signed_body(manifest: Manifest) -> bytes:
    """The bytes a marker's signature covers: what identifies the content (id, namespace,
    generation, world size, commit number, whether it was an overwrite, and every file's path,
    size, CRC32C, SHA-256, rank and node), as canonical JSON. Not the commit time, timings,
    provenance, topology or version: promotion changes some of them, and none says what the
    content is."""
    body = {
        "format": SIGNED_FORMAT,
        "checkpoint_id": manifest.checkpoint_id,
        "namespace": manifest.namespace,
        "generation": manifest.generation,
        "world_size": manifest.world_size,
        "seq": manifest.seq,
        "overwrite": manifest.overwrite,
        "files": [
            {**asdict(f), "crc32c": f"{f.crc32c:08x}"} for f in sorted(manifest.files, key=lambda f: f.path)
        ],
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signed(manifest: Manifest, keys: SigningKeys | None) -> Manifest:
    """``manifest`` signed with ``keys`` (unchanged when signing is off); every file must carry
    its SHA-256 (ValueError otherwise: a signature over CRCs alone would protect nothing)."""
    if keys is None:
        return manifest
    if missing := [f.path for f in manifest.files if f.sha256 is None]:
        raise ValueError(f"cannot sign {manifest.checkpoint_id}: no SHA-256 for {missing}")
    return replace(manifest, signature=keys.sign(signed_body(manifest)))


def signature_problem(manifest: Manifest, keys: SigningKeys) -> str | None:
    """Why ``manifest`` is not signed by one of ``keys`` (one line, naming the key's variable);
    None when it is."""
    if manifest.signature is None:
        return f"unsigned commit marker (signing is on: {keys.key_env} is set)"
    if not keys.accepts(signed_body(manifest), manifest.signature):
        return f"commit marker signature does not match the key in {keys.key_env} or an accepted key"
    if missing := [f.path for f in manifest.files if f.sha256 is None]:
        return f"signed commit marker names no SHA-256 for {', '.join(missing)}"
    return None


def load_record(format_: str, data: bytes) -> dict[str, Any]:
    """The body of a record's JSON bytes; ValueError unless it has format ``format_``."""
    body = json.loads(data)
    if not isinstance(body, dict) or body.get("format") != format_:
        raise ValueError(f"expected format {format_!r}")
    return body


def file_entry(checkpoint_id: str, generation: str, f: Mapping[str, Any]) -> FileEntry:
    """One validated file entry of a record (its path must stay inside ``generation``)."""
    return FileEntry(
        path=_checked(checkpoint_id, generation, str(f["path"])),
        size=_non_negative(f["size"]),
        crc32c=int(str(f["crc32c"]), 16),
        rank=None if f.get("rank") is None else int(f["rank"]),
        node=int(f.get("node", 0)),
        sha256=None if f.get("sha256") is None else _sha256(f["sha256"]),
    )


def _sha256(value: object) -> str:
    text = str(value)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"bad sha256 {text!r}")
    return text


def _checked(checkpoint_id: str, generation: str, path: str) -> str:
    checked_file_path(checkpoint_id, path)
    if not path.startswith(f"{generation}/"):
        raise ValueError(f"file {path!r} is outside generation {generation!r}")
    return path


def _non_negative(value: object) -> int:
    number = int(str(value))
    if number < 0:
        raise ValueError(f"negative size {number}")
    return number


def read_manifest(tier: Tier, checkpoint_id: str, *, trust: MarkerTrust) -> Manifest:
    """The marker of ``checkpoint_id`` in ``tier``, if ``trust`` accepts it.

    Raises ``FileNotFoundError`` when there is no marker (not committed there) and
    :class:`IntegrityError` when the marker is malformed, names another checkpoint, was committed
    by a run of another namespace (copied here: its files and number are not this run's) or is not
    signed by the reader's keys.
    """
    where = f"tier {tier.name}: {marker_path(checkpoint_id)}"
    data = tier.read_bytes(marker_path(checkpoint_id))
    return parse_marker(data, where=where, trust=trust, checkpoint_id=checkpoint_id)


def parse_marker(
    data: bytes, *, where: str, trust: MarkerTrust, checkpoint_id: str | None = None
) -> Manifest:
    """A marker's bytes (its own file, or a copy held in a peer's mirror), with the checks of
    :func:`read_manifest`: :class:`IntegrityError` naming ``where`` when malformed, of another
    checkpoint than ``checkpoint_id`` (when given), of another namespace than ``trust``'s, or not
    signed by its keys."""
    manifest = Manifest.from_json(data, where=where)
    if checkpoint_id is not None and manifest.checkpoint_id != checkpoint_id:
        raise IntegrityError(f"{where}: marker names checkpoint {manifest.checkpoint_id!r}")
    if None not in (manifest.namespace, trust.namespace) and manifest.namespace != trust.namespace:
        raise IntegrityError(
            f"{where}: marker of namespace {manifest.namespace!r} in a tier of namespace"
            f" {trust.namespace!r}: copied from another run, not a copy of this one (move it back"
            " to its own namespace, or delete it)"
        )
    if trust.keys is not None and (problem := signature_problem(manifest, trust.keys)):
        raise IntegrityError(f"{where}: {problem}; refused (nothing it names is read)")
    return manifest


def file_digests(
    tier: Tier, path: str, progress: Callable[[int], None] | None = None, *, sha256: bool
) -> tuple[int, int, str | None]:
    """``(size, crc32c, sha256)`` of a stored file, in one pass (``sha256``: None unless asked)."""
    size, digest = 0, Digest(sha256=sha256)
    for chunk in tier.iter_chunks(path):
        size += len(chunk)
        digest.update(chunk)
        if progress is not None:
            progress(len(chunk))
    return size, digest.crc, digest.sha256


def copy_problems(
    tier: Tier,
    manifest: Manifest,
    *,
    verify: bool,
    entries: Iterable[FileEntry] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """What makes a copy unusable: one line per missing, short/long or (``verify``) corrupt file.

    ``entries`` limits the check to some files (a rank's share; a node's files); default all.
    ``progress`` is told the size of each chunk read to verify.
    """
    problems: list[str] = []
    wanted = list(manifest.files if entries is None else entries)
    sizes = stored_sizes(tier, manifest, wanted)
    for entry in wanted:
        path = checkpoint_file(manifest.checkpoint_id, entry.path)
        problem = _presence_problem(path, entry, sizes[path])
        if problem is None and verify:
            sha = entry.sha256 is not None
            problem = entry_problem(path, entry, *file_digests(tier, path, progress, sha256=sha))
        if problem is not None:
            problems.append(problem)
    return problems


def stored_sizes(tier: Tier, manifest: Manifest, entries: Iterable[FileEntry]) -> dict[str, int | None]:
    """``{tier-relative path: size}`` of the ``entries``' files of ``manifest`` as ``tier`` stores
    them (None: absent). A stat each, except where the tier lists more cheaply
    (``capabilities.listing_page``) and a generation's files to check outnumber the pages its
    listing takes (the marker knows how many files the generation holds): then one listing of
    that generation. A save of 10,000 files into S3 checks them in 10 LISTs, not 10,000 HEADs; a
    rank checking its 8 of them still asks for its own."""
    page = tier.capabilities.listing_page
    held = Counter(entry.path.partition("/")[0] for entry in manifest.files)
    by_generation: dict[str, list[str]] = {}
    sizes: dict[str, int | None] = {}
    for entry in entries:
        path = checkpoint_file(manifest.checkpoint_id, entry.path)
        generation, nested, _name = entry.path.partition("/")
        if nested and page:
            by_generation.setdefault(generation, []).append(path)
        else:
            sizes[path] = _stat_size(tier, path)
    for generation, paths in by_generation.items():
        if len(paths) > -(-held[generation] // page):
            directory = checkpoint_file(manifest.checkpoint_id, generation)
            listed = {info.path: info.size for info in tier.find(directory)}
            sizes.update((path, listed.get(path)) for path in paths)
        else:
            sizes.update((path, _stat_size(tier, path)) for path in paths)
    return sizes


def _stat_size(tier: Tier, path: str) -> int | None:
    try:
        return tier.stat(path).size
    except FileNotFoundError:
        return None


def size_problem(tier: Tier, path: str, entry: FileEntry) -> str | None:
    """Why the file stored at ``path`` is not ``entry``'s by presence and size; None when it is."""
    return _presence_problem(path, entry, _stat_size(tier, path))


def _presence_problem(path: str, entry: FileEntry, size: int | None) -> str | None:
    return f"{path}: missing" if size is None else entry_problem(path, entry, size)


def entry_problem(
    path: str, entry: FileEntry, size: int, crc: int | None = None, sha256: str | None = None
) -> str | None:
    """Why a stored file of ``size`` bytes (and CRC32C ``crc``, SHA-256 ``sha256``, when known)
    does not match its marker ``entry``, as one line naming ``path`` and what was expected; None
    when it matches. The SHA-256 is compared when both the entry and the caller have one."""
    if size != entry.size:
        return f"{path}: {size} bytes, marker says {entry.size}"
    if crc is not None and crc != entry.crc32c:
        return f"{path}: CRC32C {crc:08x}, marker says {entry.crc32c:08x}"
    if sha256 is not None and entry.sha256 is not None and sha256 != entry.sha256:
        return f"{path}: SHA-256 {sha256[:16]}..., marker says {entry.sha256[:16]}..."
    return None
