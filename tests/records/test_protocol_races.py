"""Two races the model of the commit protocol found (tests/records/machine_model.py), each against
the real executor on a real tier: a marker's read and its delete are not atomic, so a retirement
gives way to a newer number of the id, and a promotion does not publish a generation a drop is
removing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tierstore.config import Config
from tierstore.errors import IntegrityError
from tierstore.ids import checkpoint_file, marker_path
from tierstore.records.activity import held
from tierstore.records.marker import FileEntry, Manifest, read_manifest
from tierstore.records.protocol import claim, drop, publish
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

GEN_OLD, GEN_NEW = "g00000000001aaaaaaaa", "g00000000002bbbbbbbb"


def committed(tier: Tier, checkpoint_id: str, generation: str, *, seq: int) -> Manifest:
    tier.write_bytes(checkpoint_file(checkpoint_id, f"{generation}/r0"), b"x" * 8)
    manifest = Manifest(checkpoint_id, generation, 1, (FileEntry(f"{generation}/r0", 8, 0),), seq=seq)
    assert publish(tier, manifest, replace=False, trust=MarkerTrust()) is None
    return manifest


def test_a_retirement_gives_way_to_a_newer_number_of_its_id(make_config: Callable[..., Config]) -> None:
    """An overwrite claimed a number above the retired commit's: the retirement leaves the marker
    (the overwrite drops the old generation itself once its marker stands)."""
    tier = make_config("local").make_tiers(node=0)[0]
    committed(tier, "step_1", GEN_OLD, seq=1)
    claim(tier, "step_1", GEN_NEW)  # an overwrite on its way
    assert drop(tier, "step_1", GEN_OLD, committed=True, trust=MarkerTrust()) is False
    assert read_manifest(tier, "step_1", trust=MarkerTrust()).generation == GEN_OLD


def test_a_retirement_without_a_newer_number_drops_the_copy(make_config: Callable[..., Config]) -> None:
    """The same retirement can fail: without the newer number it withdraws the marker and the data."""
    tier = make_config("local").make_tiers(node=0)[0]
    committed(tier, "step_1", GEN_OLD, seq=1)
    claim(tier, "step_2", GEN_NEW)  # another id's number does not hold it back
    assert drop(tier, "step_1", GEN_OLD, committed=True, trust=MarkerTrust()) is True
    assert not tier.exists(marker_path("step_1"))


def test_a_promotion_does_not_publish_a_generation_a_drop_is_removing(
    make_config: Callable[..., Config],
) -> None:
    tier = make_config("local").make_tiers(node=0)[0]
    tier.write_bytes(checkpoint_file("step_1", f"{GEN_OLD}/r0"), b"x" * 8)
    manifest = Manifest("step_1", GEN_OLD, 1, (FileEntry(f"{GEN_OLD}/r0", 8, 0),), seq=3)
    with held(tier, "drop", "step_1", GEN_OLD), pytest.raises(IntegrityError, match="a drop is removing"):
        publish(tier, manifest, replace=False, log=True, trust=MarkerTrust())
    assert not tier.exists(marker_path("step_1"))
    assert (
        publish(tier, manifest, replace=False, log=True, trust=MarkerTrust()) is None
    )  # once the drop is over
