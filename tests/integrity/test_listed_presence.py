"""An S3 copy's files are checked by listing their generation (``stored_sizes``) where that takes
fewer requests than a HEAD per file: the listing must see exactly what a HEAD each would, so that a
missing, short or long file still stops a marker, and a file of another generation or id, or a
neighbour whose key only starts like a checkpoint's, never stands in for one."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import boto3
import pytest

from tests.http_faults import HttpFaultProxy
from tests.simulated_job import BLOB, manifest_for
from tierstore.errors import IntegrityError, TierUnavailableError
from tierstore.ids import marker_path
from tierstore.records.marker import FileEntry, Manifest, copy_problems, stored_sizes
from tierstore.records.protocol import claim, publish
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier, make_tier
from tierstore.tiers.s3 import S3TierConfig
from tierstore.tiers.s3.tier import S3Tier


@pytest.fixture
def s3(s3_endpoint: str, s3_bucket: str) -> Tier:
    config = S3TierConfig(name="s3", type="s3", url=f"s3://{s3_bucket}/job", endpoint_url=s3_endpoint)
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
        publish(s3, manifest.with_changes(seq=seq), replace=False, log=False, trust=MarkerTrust())
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


# --- review of the listing path (805b3af) and of S3Tier.delete through botocore (3087717) ---

GEN_A, GEN_B = "g0000000000a00000000", "g0000000000b00000000"


def _tier(endpoint: str, url: str, namespace: str | None, **more: object) -> S3Tier:
    config = S3TierConfig(name="s3", type="s3", url=url, endpoint_url=endpoint, **more)
    tier = make_tier(config, namespace=namespace, node=0)
    assert isinstance(tier, S3Tier)
    return tier


def _one_head_each(tier: Tier, paths: Iterable[str]) -> dict[str, int | None]:
    found: dict[str, int | None] = {}
    for path in paths:
        try:
            found[path] = tier.stat(path).size
        except FileNotFoundError:
            found[path] = None
    return found


@pytest.mark.parametrize("namespace", [None, "run"])
@pytest.mark.parametrize("prefix", ["", "/deep/prefix/"])
def test_the_listing_answers_as_a_head_each_across_generations_and_nesting(
    s3_endpoint: str, s3_bucket: str, prefix: str, namespace: str | None
) -> None:
    """Two generations, nested names, a file with no generation directory, neighbours in the
    directory the manifest does not name, and the same names under a sibling namespace or a
    neighbouring prefix: the listing and a HEAD each agree on every path, present or not."""
    tier = _tier(s3_endpoint, f"s3://{s3_bucket}{prefix}", namespace)
    names = [
        "r0.distcp",
        "sub/dir/r1.distcp",
        "sub/r2.distcp",
        "a-b_c.d",
        "missing.distcp",
        "short.distcp",
        ".metadata",
    ]
    entries = [FileEntry(f"{g}/{n}", 10, 0) for g in (GEN_A, GEN_B) for n in names]
    entries.append(FileEntry("loose", 10, 0))
    manifest = Manifest("step_9", GEN_A, 1, tuple(entries))
    for entry in entries:
        if not entry.path.endswith("missing.distcp"):
            size = 9 if "short" in entry.path else 10
            tier.write_bytes(f"step_9/{entry.path}", b"x" * size)
    for other in ("parts/p0.json", "sub/dir/", "sub", "missing.distcp/x"):
        tier.write_bytes(f"step_9/{GEN_A}/{other}", b"yy")
    outside = _tier(s3_endpoint, f"s3://{s3_bucket}{prefix}", f"{namespace or ''}x")
    for entry in entries:
        outside.write_bytes(f"step_9/{entry.path}", b"z" * 10)
    listed = stored_sizes(tier, manifest, entries)
    assert listed == _one_head_each(tier, listed)
    assert [p for p, s in listed.items() if s is None] == [
        f"step_9/{GEN_A}/missing.distcp",
        f"step_9/{GEN_B}/missing.distcp",
    ]
    assert len(listed) == len(entries)


@pytest.mark.slow  # over 1,000 objects written to moto first (6 s): make test runs it, make quick does not
def test_a_generation_past_one_page_is_listed_whole(s3: Tier, s3_endpoint: str) -> None:
    """1,003 files in one generation: the listing takes two pages, and a missing or short file on
    either page is found as a HEAD would find it."""
    assert isinstance(s3, S3Tier)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    entries = [FileEntry(f"{GEN_A}/f{i:05d}", 3, 0) for i in range(1003)]
    manifest = Manifest("step_7", GEN_A, 1, tuple(entries))

    def put(entry: FileEntry) -> None:
        if entry.path.endswith(("f01002", "f00000")):
            return  # missing: one on the first page, one on the second
        body = b"ab" if entry.path.endswith("f01001") else b"abc"
        client.put_object(Bucket=s3.bucket, Key=s3._key(f"step_7/{entry.path}"), Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, entries))
    problems = copy_problems(s3, manifest, verify=False)
    assert problems == [
        f"step_7/{GEN_A}/f00000: missing",
        f"step_7/{GEN_A}/f01001: 2 bytes, marker says 3",
        f"step_7/{GEN_A}/f01002: missing",
    ]


class _HoleAt(S3Tier):
    """An S3 tier where another actor removes a file just before or just after the marker lands."""

    victim = ""
    when = "after"

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        marker = path.endswith("/commit.json") and self.victim
        if marker and self.when == "before":
            self.delete(self.victim)
        super().publish(path, data, create_only=create_only)
        if marker and self.when == "after":
            self.delete(self.victim)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_file_removed_around_the_marker_withdraws_it_with_the_listing(
    s3_endpoint: str, s3_bucket: str, when: str
) -> None:
    """Eight files of one generation (listed, not a HEAD each): a file removed after the first
    check, before or after the marker's PUT, is seen by the check after it: the marker goes."""
    config = S3TierConfig(name="s3", type="s3", url=f"s3://{s3_bucket}/job", endpoint_url=s3_endpoint)
    tier = _HoleAt(config, namespace="run")
    manifest = manifest_for(5, 8, "run")
    _write_all(tier, 5)
    tier.victim, tier.when = f"{manifest.checkpoint_id}/{manifest.files[2].path}", when
    seq = claim(tier, manifest.checkpoint_id, manifest.generation)
    with pytest.raises(IntegrityError, match="marker withdrawn"):
        publish(tier, manifest.with_changes(seq=seq), replace=False, log=False, trust=MarkerTrust())
    assert not tier.exists(marker_path(manifest.checkpoint_id))


def test_delete_through_botocore_keeps_the_tiers_answers(s3_endpoint: str, s3_bucket: str) -> None:
    """S3Tier.delete (a DELETE through botocore): a missing key is fine; a missing bucket, a 503
    past the tier's attempts and a refused connection are TierUnavailableError naming the tier;
    a 503 within them is retried to success."""
    tier = _tier(s3_endpoint, f"s3://{s3_bucket}/job", "run")
    tier.delete("nothing/here")
    gone = _tier(s3_endpoint, f"s3://{s3_bucket}-gone/job", "run")
    with pytest.raises(TierUnavailableError, match=r"s3.*delete x.*does not exist") as caught:
        gone.delete("x")
    assert caught.value.tier == "s3"
    url = urlsplit(s3_endpoint)
    assert url.hostname is not None and url.port is not None
    s3_tier_ok = _tier(s3_endpoint, f"s3://{s3_bucket}/job", None)
    s3_tier_ok.write_bytes("obj", b"1")
    deletes: list[str] = []

    def first_two(method: str, path: str) -> bool:
        if method != "DELETE":
            return False
        deletes.append(path)
        return len(deletes) <= 2

    with HttpFaultProxy(url.hostname, url.port, rate=1.0, faults=("503",), only=first_two) as px:
        tier = _tier(px.endpoint, f"s3://{s3_bucket}/job", None, max_attempts=3)
        tier.delete("obj")
        assert len(deletes) == 3 and not tier.exists("obj")
        px.configure(rate=1.0, faults=("503",), only=lambda m, _p: m == "DELETE")
        tier = _tier(px.endpoint, f"s3://{s3_bucket}/job", None, max_attempts=2)
        with pytest.raises(TierUnavailableError, match=r"delete obj.*SlowDown.*503"):
            tier.delete("obj")
    closed = _tier("http://127.0.0.1:9", f"s3://{s3_bucket}/job", None, max_attempts=2)
    with pytest.raises(TierUnavailableError, match=r"delete obj: cannot reach") as caught:
        closed.delete("obj")
    assert caught.value.tier == "s3"
