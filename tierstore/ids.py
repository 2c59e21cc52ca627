"""Checkpoint ids, every tier-relative path, and what "newest" means: the only place paths are built.

The layout inside each tier root (``<tier path or url>/<namespace>``) is docs/design.md, "Layout
inside a tier". A *generation* is one save attempt of an id. Data never overwrites a committed
generation in place: an overwrite writes a new generation and swaps the marker, so the old copy stays
loadable until the new one commits.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterable

from tierstore.errors import InvalidCheckpointIdError

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
"""Characters a checkpoint id may use."""

MAX_ID_LENGTH = 200
INTERNAL_DIR = ".tierstore"
"""The one name inside a tier root reserved for tierstore itself; it is not a valid checkpoint id."""

MARKER_NAME = "commit.json"
METADATA_NAME = ".metadata"
PARTS_DIR = "parts"
_GENERATION = re.compile(r"g[0-9a-f]{8,40}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]+")
_STEP = re.compile(r"(\d+)(?!.*\d)")


def validate_checkpoint_id(value: object) -> str:
    """Return ``value`` as a checkpoint id, or raise :class:`InvalidCheckpointIdError` saying why.

    An id is a single name made of ``[A-Za-z0-9._-]``, at most 200 characters, not ``.``, ``..`` or
    ``.tierstore``. It is the same in every tier; paths (``a/b``, ``/abs``) and URLs are refused.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise InvalidCheckpointIdError(
            f"checkpoint id must be a string, got {type(value).__name__}: {value!r}"
        )
    if not value:
        raise InvalidCheckpointIdError("checkpoint id must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidCheckpointIdError(
            f"checkpoint id {value[:40]!r}... is {len(value)} characters; at most {MAX_ID_LENGTH}"
        )
    if value in (".", ".."):
        raise InvalidCheckpointIdError(f"checkpoint id {value!r} is not allowed")
    if value == INTERNAL_DIR:
        raise InvalidCheckpointIdError(f"checkpoint id {value!r} is reserved for tierstore")
    if not ID_PATTERN.fullmatch(value):
        bad = sorted({c for c in value if not ID_PATTERN.fullmatch(c)})
        raise InvalidCheckpointIdError(
            f"checkpoint id {value!r} may only contain letters, digits, '.', '_' and '-'"
            f" (found {''.join(bad)!r}); it is a name, not a path"
        )
    return value


_RESERVED = frozenset({".", "..", INTERNAL_DIR})


def is_checkpoint_id(value: str) -> bool:
    """True when ``value`` is a valid checkpoint id (see :func:`validate_checkpoint_id`)."""
    if type(value) is str:  # every name a listing yields: the same rules, without the messages
        return (
            0 < len(value) <= MAX_ID_LENGTH
            and value not in _RESERVED
            and ID_PATTERN.fullmatch(value) is not None
        )
    try:
        validate_checkpoint_id(value)
    except InvalidCheckpointIdError:
        return False
    return True


def step_of(checkpoint_id: str) -> int | None:
    """The training step an id names: its last run of digits (``step_000200`` -> 200), else None."""
    match = _STEP.search(checkpoint_id)
    return int(match.group(1)) if match else None


def new_generation() -> str:
    """A fresh, time-ordered generation name (``g`` + hex millis + random)."""
    return f"g{int(time.time() * 1000):011x}{uuid.uuid4().hex[:8]}"


def is_generation(name: str) -> bool:
    """True when ``name`` has the form of a generation directory."""
    return bool(_GENERATION.fullmatch(name))


def marker_path(checkpoint_id: str) -> str:
    """Tier-relative path of the commit marker of ``checkpoint_id``."""
    return f"{checkpoint_id}/{MARKER_NAME}"


def generation_dir(checkpoint_id: str, generation: str) -> str:
    """Tier-relative directory of one generation of ``checkpoint_id``."""
    return f"{checkpoint_id}/{generation}"


def metadata_file(generation: str) -> str:
    """Path, relative to the checkpoint's directory, of DCP's metadata in a generation."""
    return f"{generation}/{METADATA_NAME}"


def is_metadata_file(path: str) -> bool:
    """True for a marker entry that names DCP's metadata."""
    return path.rsplit("/", 1)[-1] == METADATA_NAME


def data_file_name(rank: int, index: int) -> str:
    """Name (inside a generation directory) of data file ``index`` written by ``rank``."""
    return f"r{rank:05d}-{index}.distcp"


def checkpoint_file(checkpoint_id: str, rel: str) -> str:
    """Tier-relative path of a file named in a marker (``<generation>/<name>``) of ``checkpoint_id``."""
    return f"{checkpoint_id}/{rel}"


def generation_file(generation: str, name: str) -> str:
    """A file's path relative to its checkpoint's directory, as markers name it."""
    return f"{generation}/{name}"


def data_file(generation: str, rank: int, index: int) -> str:
    """Marker-relative path of data file ``index`` of ``rank`` in ``generation``."""
    return generation_file(generation, data_file_name(rank, index))


def parts_dir(checkpoint_id: str, generation: str) -> str:
    """Tier-relative directory of a generation's part records."""
    return f"{checkpoint_id}/{generation}/{PARTS_DIR}"


def split_generation_path(path: str) -> tuple[str, str, str] | None:
    """``(checkpoint id, generation, rest)`` of a tier-relative path inside a generation, else None."""
    parts = path.split("/", 2)
    if len(parts) == 3 and is_checkpoint_id(parts[0]) and is_generation(parts[1]):
        return parts[0], parts[1], parts[2]
    return None


def rank_part_path(checkpoint_id: str, generation: str, rank: int) -> str:
    """Tier-relative path of the record a rank writes once its files are durable (node-local tiers)."""
    return part_file(checkpoint_id, generation, f"rank{rank:05d}.json")  # RANK0_PART for rank 0


def part_file(checkpoint_id: str, generation: str, name: str) -> str:
    """Tier-relative path of the part record called ``name`` (as listed in :func:`parts_dir`)."""
    return f"{parts_dir(checkpoint_id, generation)}/{name}"


RANK0_PART = "rank00000.json"
"""The part record of rank 0: present only on the coordinator's node, where the marker is."""


def is_rank_part_name(name: str) -> bool:
    """True for the file name of a rank's part record (inside :func:`parts_dir`)."""
    return name.startswith("rank") and name.endswith(".json")


def node_part_path(checkpoint_id: str, generation: str, node: int) -> str:
    """Tier-relative path of the record a promoter writes once a node's part is copied to a target."""
    return part_file(checkpoint_id, generation, f"node{node:05d}.json")


def intent_path(checkpoint_id: str, generation: str) -> str:
    """Tier-relative path of the committed manifest a coordinator-node promoter leaves in a target,
    so that whichever promoter copies the last node's part can publish the marker."""
    return part_file(checkpoint_id, generation, "manifest.json")


def checked_file_path(checkpoint_id: str, rel: str) -> str:
    """Validate a file path named by a marker (``<generation>/<name>``) and return it tier-relative.

    Markers are input like any other: a path that leaves the checkpoint's directory (``..``, ``/``) or
    uses unexpected characters raises :class:`InvalidCheckpointIdError` naming it.
    """
    parts = rel.split("/")
    if (
        len(parts) < 2
        or not is_generation(parts[0])
        or not all(_FILE_NAME.fullmatch(p) and p not in (".", "..") for p in parts[1:])
    ):
        raise InvalidCheckpointIdError(
            f"file {rel!r} named by the marker of {checkpoint_id!r} is not of the form '<generation>/<name>'"
        )
    return f"{checkpoint_id}/{rel}"


def staging_dir() -> str:
    """Tier-relative directory holding writers' staging buffers (memory tiers)."""
    return f"{INTERNAL_DIR}/staging"


def writer_staging_dir(owner: str) -> str:
    """Tier-relative directory of one writer process's staging buffers."""
    return f"{staging_dir()}/{owner}"


ACTIVITY_DIR = f"{INTERNAL_DIR}/activity"
"""Tier-relative directory of activity records (saves, promotions and restores at work)."""
_ANY_GENERATION = "any"


def activity_path(kind: str, checkpoint_id: str, generation: str | None, token: str) -> str:
    """Tier-relative path of one activity record (``generation`` None: every generation)."""
    return f"{ACTIVITY_DIR}/{kind}~{checkpoint_id}~{generation or _ANY_GENERATION}~{token}.json"


def parse_activity_path(path: str) -> tuple[str, str, str | None] | None:
    """``(kind, checkpoint id, generation or None)`` of an activity record's path, else None."""
    name = path.rsplit("/", 1)[-1]
    parts = name.removesuffix(".json").split("~")
    if not name.endswith(".json") or len(parts) != 4 or not is_checkpoint_id(parts[1]):
        return None
    generation = None if parts[2] == _ANY_GENERATION else parts[2]
    if generation is not None and not is_generation(generation):
        return None
    return parts[0], parts[1], generation


CLOCK_DIR = f"{INTERNAL_DIR}/clock"
"""Tier-relative directory of clock probes: a file written to read the tier's own time (see
records/clock.py), deleted at once; one left by a process that died is removed by cleanup."""


def clock_probe_path(token: str) -> str:
    """Tier-relative path of one clock probe (``token``: unique to the process and call)."""
    return f"{CLOCK_DIR}/{token}"


CHANGES_PATH = f"{INTERNAL_DIR}/changes"
"""Tier-relative path of the tier's change stamp (see records/changes.py)."""

SWEPT_PATH = f"{INTERNAL_DIR}/swept"
"""Tier-relative path of the record of the tier's last complete cleanup (see records/sweeps.py)."""

INDEX_PATH = f"{INTERNAL_DIR}/index.json"
"""Tier-relative path of a job-wide tier's index, written by its keeper (see records/index.py)."""

COMMITS_DIR = f"{INTERNAL_DIR}/commits"
"""Tier-relative directory of the commit log (see records/log.py)."""

HEAD_PATH = f"{INTERNAL_DIR}/head"
"""Tier-relative path of the log's head record: a hint of its highest number (see records/log.py)."""


def commit_entry_path(seq: int, checkpoint_id: str, generation: str) -> str:
    """Tier-relative path of the commit-log entry ``seq`` (``<seq>~<id>~<generation>``)."""
    return f"{COMMITS_DIR}/{seq:012d}~{checkpoint_id}~{generation}"


def commit_entry_prefix(seq: int) -> str:
    """The tier-relative name every log entry numbered ``seq`` starts with (commit or void); it
    sorts before them, and after every entry of a lower number."""
    return f"{COMMITS_DIR}/{seq:012d}"


def parse_commit_entry(path: str) -> tuple[int, str, str] | None:
    """``(seq, checkpoint id, generation)`` of a commit-log entry's path, else None."""
    parts = path.rsplit("/", 1)[-1].split("~")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    if not (is_checkpoint_id(parts[1]) and is_generation(parts[2])):
        return None
    return int(parts[0]), parts[1], parts[2]


VOID_ENTRY = "void"


def void_entry_path(seq: int) -> str:
    """Tier-relative path of a *void* log entry: number ``seq`` was taken, by no commit that stands
    (a failed or dropped one). It keeps the sequence's high-water mark without naming an id."""
    return f"{COMMITS_DIR}/{seq:012d}~{VOID_ENTRY}"


def parse_void_entry(path: str) -> int | None:
    """The number of a void log entry's path, else None."""
    parts = path.rsplit("/", 1)[-1].split("~")
    if len(parts) == 2 and parts[0].isdigit() and parts[1] == VOID_ENTRY:
        return int(parts[0])
    return None


def is_newer_commit(seq: int | None, generation: str, other_seq: int | None, other_generation: str) -> bool:
    """True when the commit ``(seq, generation)`` is newer than the other one.

    By sequence when both have one; between copies from before the commit log, by generation
    (time-ordered names from one writer: the best that is known about them).
    """
    if seq is not None and other_seq is not None:
        return seq > other_seq
    return generation > other_generation


def newest_first(ids_with_seq: Iterable[tuple[str, int | None]]) -> list[str]:
    """Order ids newest first: by commit sequence (higher is newer), never by name or clock.

    An id without a sequence (None) sorts after every id with one; ties (only possible between
    unrelated namespaces' legacy markers) are broken by id, for a stable order.
    """
    return [
        i
        for i, _ in sorted(
            ids_with_seq, key=lambda item: (item[1] is not None, item[1] or 0, item[0]), reverse=True
        )
    ]


MIRROR_DIR = f"{INTERNAL_DIR}/mirror"
"""Tier-relative directory of the peer mirrors a node holds for its partner (memory tiers)."""
MIRROR_MARKER_PREFIX = "mirror-node"


def mirror_id_dir(checkpoint_id: str) -> str:
    """Tier-relative directory of every mirrored generation of ``checkpoint_id`` on this node."""
    return f"{MIRROR_DIR}/{checkpoint_id}"


def mirror_copy_path(checkpoint_id: str, rel: str) -> str:
    """Tier-relative path of the mirror copy of a file a marker names (``<generation>/<name>``)."""
    return f"{MIRROR_DIR}/{checkpoint_id}/{rel}"


def mirror_marker_path(checkpoint_id: str, generation: str, owner_node: int) -> str:
    """Tier-relative path of the mirror marker of ``owner_node``'s files of a generation."""
    return f"{MIRROR_DIR}/{checkpoint_id}/{generation}/{MIRROR_MARKER_PREFIX}{owner_node:05d}.json"


def mirror_commit_path(checkpoint_id: str, generation: str) -> str:
    """Tier-relative path of the mirrored copy of a generation's commit marker."""
    return f"{MIRROR_DIR}/{checkpoint_id}/{generation}/{MARKER_NAME}"


def mirror_status_path(checkpoint_id: str, generation: str, owner_node: int) -> str:
    """Tier-relative path of the record of whether ``owner_node``'s files reached their mirror."""
    return f"{checkpoint_id}/{generation}/mirror/node{owner_node:05d}.json"


SIGHTINGS_DIR = f"{INTERNAL_DIR}/seen"
"""Tier-relative directory of what the promoter last saw in each other tier (see
records/sightings.py): a save or restore in this tier reads it instead of asking the others."""


def sighting_path(tier_name: str) -> str:
    """Tier-relative path of the record of what was seen in the tier called ``tier_name``."""
    return f"{SIGHTINGS_DIR}/{tier_name}.json"


PROMOTER_DIR = f"{INTERNAL_DIR}/promoter"
"""Tier-relative directory of the promoters' state records (see records/promoter_state.py)."""


def promoter_state_path(node: int) -> str:
    """Tier-relative path of the state record of node ``node``'s promoter."""
    return f"{PROMOTER_DIR}/node{node:05d}.json"


CONFLICTS_DIR = f"{INTERNAL_DIR}/conflicts"
"""Tier-relative directory of conflict records: copies the promoter did not let replace (or be
replaced by) another content of the same id in a lower tier (see records/conflicts.py)."""


def conflict_path(checkpoint_id: str, generation: str, target: str) -> str:
    """Tier-relative path of the conflict record of this copy with the tier called ``target``."""
    return f"{CONFLICTS_DIR}/{checkpoint_id}~{generation}~{target}.json"


def parse_conflict_path(path: str) -> tuple[str, str, str] | None:
    """``(checkpoint id, generation, target tier)`` of a conflict record's path, else None."""
    name = path.rsplit("/", 1)[-1]
    parts = name.removesuffix(".json").split("~")
    if not name.endswith(".json") or len(parts) != 3:
        return None
    if not (is_checkpoint_id(parts[0]) and is_generation(parts[1])):
        return None
    return parts[0], parts[1], parts[2]


KEEPER_DIR = f"{INTERNAL_DIR}/keeper"
"""Tier-relative directory of a job-wide tier's keeper leases, one record per epoch
(see records/lease.py)."""


def lease_path(epoch: int) -> str:
    """Tier-relative path of the lease record of keeper epoch ``epoch`` (>= 1)."""
    return f"{KEEPER_DIR}/lease-{epoch:012d}.json"


def parse_lease_path(path: str) -> int | None:
    """The epoch of a lease record's path, else None."""
    name = path.rsplit("/", 1)[-1]
    digits = name.removeprefix("lease-").removesuffix(".json")
    if not (name.startswith("lease-") and name.endswith(".json") and digits.isdigit()):
        return None
    return int(digits)
