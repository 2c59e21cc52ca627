"""When the job signs its markers, its keeper signs the index of a job-wide tier the same way
(records/index.py), and every reader refuses an index without a valid signature as no index: it
lists the tier instead. A forged index naming copies the tier does not hold would otherwise make a
node believe they are there (and delete its own copies for them)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from tests.simulated_job import manifest_for
from tierstore.config import Config
from tierstore.ids import INDEX_PATH, marker_path
from tierstore.promote.discovery import MarkerCache, SeenCopy, discover, index_of
from tierstore.promote.sidecar import Promoter
from tierstore.records.catalog import marker_times
from tierstore.records.changes import read_stamp, touch
from tierstore.records.index import Index, read_index, write_index
from tierstore.records.lease import Holder, Lease, claim, renew
from tierstore.records.marker import Manifest, signed
from tierstore.signing import MarkerTrust, SigningKeys, keys_from_env
from tierstore.tiers import Tier

KEY = "k" * 32
OTHER_KEY = "o" * 32
GHOST = manifest_for(99, 2, "").checkpoint_id
"""A checkpoint no tier holds, that a forged index names."""


def _signed(index: int, keys: SigningKeys) -> Manifest:
    """Checkpoint ``index``'s marker, signed (every file names a SHA-256, as signing requires)."""
    manifest = manifest_for(index, 2, "")
    files = tuple(dataclasses.replace(f, sha256="0" * 64) for f in manifest.files)
    return signed(manifest.with_changes(files=files), keys)


def _save(tier: Tier, index: int, keys: SigningKeys) -> str:
    manifest = _signed(index, keys)
    tier.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    touch(tier)
    return manifest.checkpoint_id


def _with_ghost(tier: Tier, trust: MarkerTrust) -> Index:
    """The index of ``tier`` as a listing under its stamp now gives it, plus :data:`GHOST`."""
    token = read_stamp(tier)
    found: dict[str, SeenCopy] = dict(discover(tier, MarkerCache(trust)))
    found[GHOST] = SeenCopy(dataclasses.replace(next(iter(found.values())).copy, checkpoint_id=GHOST), None)
    return index_of(token, found, 99, [])


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> SigningKeys:
    """The job signs: the signing key in the environment."""
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)
    found = keys_from_env("TIERSTORE_SIGNING_KEY")
    assert found is not None
    return found


def test_an_index_is_read_only_with_a_signature_of_an_accepted_key(
    make_config: Callable[..., Config], keys: SigningKeys
) -> None:
    """Signed by the job's key: read with it, and without keys (a job that does not sign ignores
    signatures). Unsigned, signed with another key, or changed after signing: no index, with keys."""
    (tier,) = make_config("shared").make_tiers(node=0)
    _save(tier, 1, keys)
    index = _with_ghost(tier, MarkerTrust(keys=keys))
    write_index(tier, index, keys)
    assert read_index(tier, keys) == index and read_index(tier) == index

    write_index(tier, index)
    assert read_index(tier, keys) is None, "unsigned"
    assert read_index(tier) == index, "a job that does not sign reads an unsigned index as before"
    other = keys_from_env("OTHER", environ={"OTHER": OTHER_KEY})
    write_index(tier, index, other)
    assert read_index(tier, keys) is None, "signed with a key the job does not accept"
    write_index(tier, index, keys)
    blob = tier.read_bytes(INDEX_PATH)
    forged = dataclasses.replace(index, highest=index.highest + 1)
    write_index(tier, forged, keys)
    tier.write_bytes(INDEX_PATH, _spliced(blob, tier.read_bytes(INDEX_PATH)))
    assert read_index(tier, keys) is None, "a row changed under another index's signature"


def _spliced(signed_blob: bytes, other_blob: bytes) -> bytes:
    """``other_blob``'s index carrying ``signed_blob``'s signature."""
    import json
    import zlib

    signature = json.loads(zlib.decompress(signed_blob))["signature"]
    body = json.loads(zlib.decompress(other_blob))
    body["signature"] = signature
    return zlib.compress(json.dumps(body).encode())


def test_a_watcher_refuses_an_unsigned_index_when_the_job_signs(
    make_config: Callable[..., Config], keys: SigningKeys
) -> None:
    """A node whose shared tier another node keeps takes the keeper's index made under the stamp it
    reads only when the index is signed by the job's key; an unsigned one (forged: it names a copy
    the tier does not hold) is no index: the tier is listed."""
    lease_s = 0.5  # every read of the lease finds it renewed (the test renews first): never stale
    config = make_config("local", "shared", promote={"keeper_lease": f"{lease_s}s", "interval": "1h"})
    shared = config.make_tiers(node=0)[1]
    trust = MarkerTrust(keys=keys)
    held = [Lease(1, Holder(0, "another-host", "pidns", 1, "their-token", time.time()))]
    assert claim(shared, held[0])

    def watcher_pass() -> set[str]:
        time.sleep(lease_s)  # the stamp of a tier kept elsewhere is read once a lease
        held[0] = held[0].renewed(read_stamp(shared))  # the keeper, alive, names the stamp it read
        renew(shared, held[0])
        watcher.run_once()
        return set(watcher.view.found["shared"])

    first = _save(shared, 1, keys)
    watcher = Promoter(config, node=1)
    assert watcher_pass() == {first}
    assert set(watcher.context.keepers.watched()) == {"shared"}
    second = _save(shared, 2, keys)
    write_index(shared, _with_ghost(shared, trust))
    assert watcher_pass() == {first, second}, "unsigned: listed"
    third = _save(shared, 3, keys)
    write_index(shared, _with_ghost(shared, trust), keys)
    assert watcher_pass() == {first, second, third, GHOST}, "signed by the job's key: taken"


def test_a_keeper_seeds_its_first_look_only_from_a_signed_index_when_the_job_signs(
    make_config: Callable[..., Config], keys: SigningKeys
) -> None:
    """A keeper's first look takes the copies its predecessor's index holds settled instead of
    reading their markers (a copy taken so has no manifest) only when the index is signed by the
    job's key; from an unsigned one it takes nothing: every marker is read."""
    config = make_config("shared", promote={"interval": "1h"})
    (shared,) = config.make_tiers(node=0)
    trust = MarkerTrust(keys=keys)
    ids = {_save(shared, i, keys) for i in (1, 2, 3)}
    mtimes = marker_times(shared)
    listed = discover(shared, MarkerCache(trust))
    settled = {i: dataclasses.replace(s, settled_mtime=mtimes[i]) for i, s in listed.items()}
    index = index_of(read_stamp(shared), settled, 3, [])

    def first_look(signed_with: SigningKeys | None) -> dict[str, SeenCopy]:
        write_index(shared, index, signed_with)
        keeper = Promoter(config)
        try:
            found = dict(keeper.look().found["shared"])
            assert keeper.context.keepers.kept() == {"shared"}
            return found
        finally:
            keeper.context.keepers.release()

    unsigned = first_look(None)
    assert set(unsigned) == ids and all(s.manifest is not None for s in unsigned.values()), "read"
    seeded = first_look(keys)
    assert set(seeded) == ids and all(s.manifest is None for s in seeded.values()), "taken"
