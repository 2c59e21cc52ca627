"""An S3 copy's files are checked by listing their generation (``stored_sizes``) where that takes
fewer requests than a HEAD per file: the listing must see exactly what a HEAD each would, so that a
missing, short or long file still stops a marker, and a file of another generation or id, or a
neighbour whose key only starts like a checkpoint's, never stands in for one."""

from __future__ import annotations

import pytest

from tests.simulated_job import BLOB, manifest_for
from tierstore.errors import IntegrityError
from tierstore.ids import marker_path
from tierstore.records.marker import copy_problems, stored_sizes
from tierstore.records.protocol import claim, publish
from tierstore.tiers import Tier, make_tier
from tierstore.tiers.s3 import S3TierConfig


@pytest.fixture
def s3(s3_endpoint: str, s3_bucket: str) -> Tier:
    config = S3TierConfig(name="s3", type="s3", url=f"s3://{s3_bucket}/job",
                          endpoint_url=s3_endpoint)  # fmt: skip
    return make_tier(config, namespace="run", node=0)


def _write_all(tier: Tier, index: int, ranks: int = 8) -> None:
    manifest = manifest_for(index, ranks, "run")
    for entry in manifest.files:
        tier.write_bytes(f"{manifest.checkpoint_id}/{entry.path}", BLOB)


def test_the_listing_sees_every_file_as_a_head_would(s3: Tier) -> None:
    manifest = manifest_for(1, 8, "run")
    _write_all(s3, 1)
    listed = stored_sizes(s3, manifest, manifest.files)
    one_each = {path: s3.stat(path).size for path in listed}
    assert listed == one_each and set(listed.values()) == {len(BLOB)}


@pytest.mark.parametrize("damage", ["delete", "short", "long"])
def test_a_damaged_file_stops_the_marker(s3: Tier, damage: str) -> None:
    manifest = manifest_for(2, 8, "run")
    _write_all(s3, 2)
    victim = f"{manifest.checkpoint_id}/{manifest.files[3].path}"
    if damage == "delete":
        s3.delete(victim)
    else:
        s3.write_bytes(victim, BLOB[:-1] if damage == "short" else BLOB + b"x")
    seq = claim(s3, manifest.checkpoint_id, manifest.generation)
    with pytest.raises(IntegrityError, match=victim.replace(".", r"\.")):
        publish(s3, manifest.with_changes(seq=seq), replace=False, log=False)
    assert not s3.exists(marker_path(manifest.checkpoint_id)), "no marker over a damaged copy"


def test_files_of_other_generations_and_ids_do_not_stand_in(s3: Tier) -> None:
    """The same names under an older generation of the id, and under an id whose name extends
    this one's (``step_00000300`` and ``step_000003000``), are other objects: still missing."""
    manifest = manifest_for(3, 8, "run")
    older = manifest_for(3, 8, "run").with_changes(generation="g0000000000000000001")
    for entry in manifest.files:
        name = entry.path.partition("/")[2]
        s3.write_bytes(f"{manifest.checkpoint_id}/{older.generation}/{name}", BLOB)
        s3.write_bytes(f"{manifest.checkpoint_id}0/{entry.path}", BLOB)
        s3.write_bytes(f"{manifest.checkpoint_id}/{manifest.generation}0/{name}", BLOB)
    problems = copy_problems(s3, manifest, verify=False)
    assert len(problems) == len(manifest.files)
    assert all(p.endswith(": missing") for p in problems), problems


def test_a_ranks_share_is_checked_alone(s3: Tier) -> None:
    """A rank checking one file of eight (a restore's share) gets the same answer."""
    manifest = manifest_for(4, 8, "run")
    _write_all(s3, 4)
    victim = manifest.files[5]
    s3.delete(f"{manifest.checkpoint_id}/{victim.path}")
    assert copy_problems(s3, manifest, verify=False, entries=[manifest.files[0]]) == []
    problems = copy_problems(s3, manifest, verify=False, entries=[victim])
    assert problems == [f"{manifest.checkpoint_id}/{victim.path}: missing"]
