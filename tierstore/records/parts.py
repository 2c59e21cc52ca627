"""Part records: some ranks' files of a generation, complete and durable in one tier.

Writers leave one per rank in node-local tiers when a save spans several nodes (other nodes never see
the coordinator's marker, so their promoters discover their part through these); promoters leave one
per node in a job-wide target (the marker there is published once every node's part is in).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from tierstore.errors import IntegrityError
from tierstore.ids import is_generation, is_rank_part_name, part_file, parts_dir
from tierstore.records.marker import FileEntry, dump_record, file_entry, load_record
from tierstore.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartRecord:
    """Some ranks' files of a generation, complete and durable in one tier.

    Writers leave one per rank in node-local tiers (other nodes never see the coordinator's marker, so
    their promoters discover work through these); promoters leave one per node in a job-wide target.
    """

    checkpoint_id: str
    generation: str
    node: int
    ranks: tuple[int, ...]
    files: tuple[FileEntry, ...]
    seq: int | None = None
    world_size: int = 1
    written_at: float = field(default_factory=time.time)
    node_ranks: tuple[int, ...] = ()
    """Every rank of the writing node (rank records): the node's part is complete when a record
    exists for each. Empty in records from before this field: they are taken as complete."""
    coordinator_host: str = ""
    """The host of the save's coordinator (rank 0): only its node holds the save's marker in a
    node-local tier, so only it can say the save never committed. Empty in records from before
    this field, and in the per-node records promoters leave in job-wide tiers."""
    confirmed: bool = False
    """``seq`` is the commit's final number: a promoter read it from the coordinator's committed
    manifest (the coordinator takes a new number at its commit when another save committed after
    this one was planned), and rewrote the record with it."""

    def to_json(self) -> bytes:
        """Serialize (CRCs as hex)."""
        return dump_record(PART_FORMAT, asdict(self), self.files)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> PartRecord:
        """Parse and validate; :class:`IntegrityError` naming ``where`` if malformed."""
        try:
            body = load_record(PART_FORMAT, data)
            checkpoint_id, generation = str(body["checkpoint_id"]), str(body["generation"])
            return cls(
                checkpoint_id=checkpoint_id,
                generation=generation,
                node=int(body["node"]),
                ranks=tuple(int(r) for r in body["ranks"]),
                files=tuple(file_entry(checkpoint_id, generation, f) for f in body["files"]),
                seq=None if body.get("seq") is None else int(body["seq"]),
                world_size=int(body.get("world_size", 1)),
                written_at=float(body.get("written_at", 0.0)),
                node_ranks=tuple(int(r) for r in body.get("node_ranks", ())),
                coordinator_host=str(body.get("coordinator_host", "")),
                confirmed=bool(body.get("confirmed", False)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: malformed part record ({exc})") from None


PART_FORMAT = "tierstore.part/1"


def part_records(tier: Tier, checkpoint_id: str) -> dict[str, list[PartRecord]]:
    """``{generation: [rank part records]}`` found under ``checkpoint_id`` in ``tier``."""
    found: dict[str, list[PartRecord]] = {}
    for generation in tier.list_dir(checkpoint_id):
        if is_generation(generation) and (records := generation_parts(tier, checkpoint_id, generation)):
            found[generation] = records
    return found


def generation_parts(tier: Tier, checkpoint_id: str, generation: str) -> list[PartRecord]:
    """The rank part records of one generation in ``tier`` (a damaged one is skipped, warned)."""
    records: list[PartRecord] = []
    for name in tier.list_dir(parts_dir(checkpoint_id, generation)):
        if not is_rank_part_name(name):
            continue
        path = part_file(checkpoint_id, generation, name)
        try:
            records.append(PartRecord.from_json(tier.read_bytes(path), where=f"tier {tier.name}: {path}"))
        except Exception as exc:  # noqa: BLE001 - a damaged record hides only that part
            logger.warning("ignoring part record: %s", exc)
    return records
