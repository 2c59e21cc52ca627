"""The head record: a hint the catalog lists each log above, never a source of order.

Over 1,200 numbers (more than :data:`~tierstore.records.catalog.WINDOW`, so a head record puts the
floor above most of the log), the candidates with a head record are the candidates of the whole
log, in the same order, whatever the record says (missing, stale, damaged, far too high, or made
in a tier whose markers were not all logged), in the cases where the log and the markers
disagree: an old id promoted late, overwrites whose entries lie on both sides of the floor, void
entries, a promotion cut between its marker and its entry.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.simulated_job import manifest_for
from tierstore import Catalog
from tierstore.config import Config, config_from_dict
from tierstore.ids import HEAD_PATH, commit_entry_path, marker_path, void_entry_path
from tierstore.records.catalog import WINDOW
from tierstore.records.log import Head, read_head
from tierstore.records.marker import Manifest
from tierstore.records.protocol import claim, publish
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

COUNT = 1_200


def _commit(tier: Tier, manifest: Manifest, *, logged: bool = True) -> None:
    """What a committed copy leaves for the catalog: its marker, and its log entry."""
    tier.publish(marker_path(manifest.checkpoint_id), manifest.to_json(), create_only=False)
    if logged:
        tier.publish(
            commit_entry_path(manifest.seq or 0, manifest.checkpoint_id, manifest.generation),
            b"",
            create_only=False,
        )


def _id(index: int) -> str:
    return f"step_{index * 100:08d}"


def _build(memory: Tier, local: Tier, ns: str) -> None:
    """``memory`` holds the newest three, ``local`` everything else, with the cases of the module
    docstring; each tier's head record says 1,203."""
    for index in range(1, COUNT + 1):
        if index not in (300, 1190):
            _commit(local, manifest_for(index, 1, ns))
    for index in (1190, 1198, 1199, 1200):
        _commit(memory, manifest_for(index, 1, ns))
    # An old id (300) and a recent one (1190) promoted into local late: logged last, at their
    # own numbers; 1190 then evicted from memory.
    _commit(local, manifest_for(300, 1, ns))
    _commit(local, manifest_for(1190, 1, ns))
    memory.delete(marker_path(_id(1190)))
    memory.delete(commit_entry_path(1190, _id(1190), manifest_for(1190, 1, ns).generation))
    # Overwrites: step 100's marker names its old generation (100) although a newer number
    # (1150, above the floor) was logged for another one that never swapped; step 50's marker
    # names its new generation (1160) and its old entry (50) stays.
    local.publish(commit_entry_path(1150, _id(100), "g" + "e" * 19), b"", create_only=False)
    local.delete(marker_path(_id(50)))
    _commit(local, manifest_for(1160, 1, ns).with_changes(checkpoint_id=_id(50)))
    # Void entries at the top, and a promotion cut after its marker (1203, never logged).
    for seq in (1201, 1202):
        local.publish(void_entry_path(seq), b"", create_only=False)
    cut = manifest_for(1203, 1, ns)
    _commit(local, cut, logged=False)
    for tier in (memory, local):
        tier.publish(HEAD_PATH, Head(1203, logged=True).encode(), create_only=False)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiers of :func:`_build`, made once per module (1,200 markers and entries take seconds)
    and copied into each test's own roots."""
    root = tmp_path_factory.mktemp("head-layout")
    specs = [
        {"name": kind, "type": kind, "path": str(root / kind / "{node}")} for kind in ("memory", "local")
    ]
    config = config_from_dict({"tiers": specs})
    memory, local = config.make_tiers(node=0)
    _build(memory, local, config.namespace)
    return root


@pytest.fixture
def job(make_config: Callable[..., Config], layout: Path, tmp_path: Path) -> tuple[Config, Tier, Tier]:
    """A test's own copy of :func:`layout`."""
    for kind in ("memory", "local"):
        shutil.copytree(layout / kind, tmp_path / kind, symlinks=True)
    config = make_config("memory", "local")
    memory, local = config.make_tiers(node=0)
    return config, memory, local


def _whole(config: Config, tiers: list[Tier]) -> list[str]:
    """The candidates from the whole logs: no head record anywhere."""
    for tier in tiers:
        tier.delete(HEAD_PATH)
    return list(Catalog(config).candidates())


def test_with_a_head_the_candidates_are_those_of_the_whole_log_in_order(
    job: tuple[Config, Tier, Tier],
) -> None:
    config, memory, local = job
    assert COUNT > 2 * WINDOW
    with_head = list(Catalog(config).candidates())
    assert with_head == _whole(config, [memory, local])
    assert with_head[:6] == [_id(1203), _id(1200), _id(1199), _id(1198), _id(1197), _id(1196)]
    assert with_head.index(_id(50)) < with_head.index(_id(1159)), "placed by its new generation"
    assert with_head.index(_id(1190)) == with_head.index(_id(1191)) + 1, "a late promotion at its number"
    assert with_head.index(_id(300)) == with_head.index(_id(301)) + 1
    assert with_head.index(_id(100)) == with_head.index(_id(101)) + 1, "placed by the committed generation"
    assert len(with_head) == COUNT + 1


def test_the_newest_is_found_above_the_floor_when_the_log_agrees_with_the_head(
    job: tuple[Config, Tier, Tier],
) -> None:
    """Without the cut marker (the head at the log's top) the first candidates come from the log
    above the floor, and the order is still the whole log's."""
    config, memory, local = job
    local.delete(marker_path(_id(1203)))
    for tier in (memory, local):
        tier.publish(HEAD_PATH, Head(1202, logged=True).encode(), create_only=False)
    candidates = Catalog(config).candidates()
    assert [next(candidates) for _ in range(3)] == [_id(1200), _id(1199), _id(1198)]
    rest = list(Catalog(config).candidates())
    assert rest == _whole(config, [memory, local])


@pytest.mark.parametrize(
    "record",
    [
        Head(600, logged=True).encode(),  # stale: far below the log's top
        Head(10**6, logged=True).encode(),  # far above anything logged
        Head(1203, logged=False).encode(),  # made where some marker had no entry
        b"{not json",
        b'{"format": "tierstore.head/1", "seq": -4, "logged": true}',
    ],
    ids=["stale", "too-high", "not-logged", "damaged", "negative"],
)
def test_whatever_the_head_says_the_order_is_the_whole_logs(
    job: tuple[Config, Tier, Tier], record: bytes
) -> None:
    """The cut marker is logged here: a head record lowered by a race below such a marker is the
    one case it could hide (docs/design.md, "The head record")."""
    config, memory, local = job
    cut = manifest_for(1203, 1, config.namespace)
    local.publish(commit_entry_path(1203, cut.checkpoint_id, cut.generation), b"", create_only=False)
    for tier in (memory, local):
        tier.publish(HEAD_PATH, record, create_only=False)
    assert list(Catalog(config).candidates()) == _whole(config, [memory, local])


def test_the_protocol_raises_the_head_and_never_lowers_it(make_config: Callable[..., Config]) -> None:
    """A claim makes the record (every marker logged: ``logged``) and raises it; a promotion of an
    older number leaves it; in a tier holding a marker the log does not name, it is made not
    ``logged`` (readers list that tier whole)."""
    config = make_config("memory", "local")
    memory, local = config.make_tiers(node=0)
    assert read_head(memory) is None
    assert claim(memory, "a", "g" + "a" * 19, floor=40) == 41
    assert read_head(memory) == Head(41, logged=True)
    older = manifest_for(7, 1, config.namespace)
    for entry in older.files:
        memory.write_bytes(f"{older.checkpoint_id}/{entry.path}", b"x" * 64)
    assert publish(memory, older, replace=False, trust=MarkerTrust()) is None  # a promotion: logged
    assert read_head(memory) == Head(41, logged=True)
    _commit(local, manifest_for(3, 1, config.namespace), logged=False)  # from before the log
    assert claim(local, "b", "g" + "b" * 19, floor=3) == 4
    assert read_head(local) == Head(4, logged=False)
