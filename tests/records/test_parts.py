"""Part records: a confirmation never leaves a record over data a drop removed meanwhile."""

from __future__ import annotations

from collections.abc import Callable

from tierstore.config import Config
from tierstore.ids import checkpoint_file, rank_part_path
from tierstore.records.marker import FileEntry
from tierstore.records.parts import PartRecord, confirm_part, part_records

GEN = "g0000000000010000000"


def test_a_confirmation_racing_a_drop_takes_its_record_back(
    make_config: Callable[..., Config],
) -> None:
    """The state a drop leaves between the confirmation's listing and its rewrite: the data gone,
    the record listed. The rewritten record would stand over missing data: it is taken back."""
    tier = make_config("memory").make_tiers(node=1)[0]
    entry = FileEntry(f"{GEN}/r00001-0.distcp", 8, 0, 1, 1)
    record = PartRecord("x", GEN, 1, (1,), (entry,), seq=3, node_ranks=(1,))
    tier.write_bytes(rank_part_path("x", GEN, 1), record.to_json())
    assert confirm_part(tier, "x", GEN, 5)
    assert part_records(tier, "x") == {}


def test_a_confirmation_rewrites_the_records_with_the_final_number(
    make_config: Callable[..., Config],
) -> None:
    tier = make_config("memory").make_tiers(node=1)[0]
    entry = FileEntry(f"{GEN}/r00001-0.distcp", 8, 0, 1, 1)
    tier.write_bytes(checkpoint_file("x", entry.path), b"12345678")
    record = PartRecord("x", GEN, 1, (1,), (entry,), seq=3, node_ranks=(1,))
    tier.write_bytes(rank_part_path("x", GEN, 1), record.to_json())
    assert confirm_part(tier, "x", GEN, 5)
    (confirmed,) = part_records(tier, "x")[GEN]
    assert (confirmed.seq, confirmed.confirmed) == (5, True)
    assert not confirm_part(tier, "x", GEN, 5), "already confirmed: nothing rewritten"
