"""Part records: a confirmation never leaves a record over data a drop removed meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tierstore.cli import main
from tierstore.config import Config
from tierstore.ids import checkpoint_file, rank_part_path
from tierstore.records.marker import FileEntry
from tierstore.records.parts import PartRecord, part_records
from tierstore.records.protocol import confirm_part

GEN = "g0000000000010000000"


def test_a_confirmation_racing_a_drop_takes_its_record_back(make_config: Callable[..., Config]) -> None:
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


def test_an_operator_drops_a_leftover_part_by_its_generation(
    make_config: Callable[..., Config], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A coordinator killed mid-save leaves node 1's part (no marker on node 1): ``tierstore drop``
    names it, and drops it when the operator names its generation."""
    config = make_config("memory")
    tier = config.make_tiers(node=1)[0]
    entry = FileEntry(f"{GEN}/r00001-0.distcp", 8, 0, 1, 1)
    tier.write_bytes(checkpoint_file("x", entry.path), b"12345678")
    record = PartRecord("x", GEN, 1, (1,), (entry,), seq=3, node_ranks=(1,))
    tier.write_bytes(rank_part_path("x", GEN, 1), record.to_json())
    path = tmp_path / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(exclude={"origin"})), encoding="utf-8")
    command = ["--config", str(path), "--node", "1", "drop", "x", "--tier", "memory"]
    assert main(command) != 0
    assert f"generations {GEN}" in capsys.readouterr().err
    assert main([*command, "--generation", GEN]) == 0
    assert part_records(tier, "x") == {} and not tier.exists(checkpoint_file("x", entry.path))
