"""One side of a conflict goes down the tiers (1dc3cab) and stays there: its copy in a middle tier
is the same content the newer save could not see, not a copy that save replaced. Judged copy by
copy, the middle tier's copy (no conflict recorded in that tier) was deleted as overtaken in the
pass that promoted it, and promoted again in the next: the whole checkpoint copied each pass."""

from __future__ import annotations

from collections.abc import Callable

from tests.promote.test_policy import _x, config
from tests.records import watched_tier
from tests.records.test_tier_local import new_process, restored, save
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.policy import retention
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


def test_a_conflicting_content_promoted_to_a_middle_tier_is_not_overtaken_there() -> None:
    """The rule: a content is replaced only where the newer save could see every copy of it."""
    newer = _x(2, overwrite=True, unseen_tiers=frozenset({"t0"}))  # it could not see t0's copy
    held = {"t0": {"x": _x(1, conflicts=frozenset({"t2"}))}, "t1": {"x": _x(1)}, "t2": {"x": newer}}
    assert retention(config({}, {}, {}), held) == []


def test_a_promoter_does_not_copy_one_side_of_a_conflict_again_each_pass(
    make_config: Callable[..., Config],
) -> None:
    config_ = make_config("watched", "shared", "local", probe_timeout="1s")
    fast, middle, _durable = config_.make_tiers(node=0)
    new_process()
    save(config_, "x", 1.0)
    new_process()
    watched_tier.DOWN.add(fast.root)  # the overwrite cannot see the fast tier's x: a conflict
    try:
        save(config_, "x", 2.0, tier="local", overwrite=True)
    finally:
        watched_tier.DOWN.discard(fast.root)
    mine = read_manifest(fast, "x", trust=MarkerTrust()).generation
    stamps = []
    for _pass in range(3):
        Promoter(config_, node=0).run_once()
        assert read_manifest(middle, "x", trust=MarkerTrust()).generation == mine, (
            "one side of the conflict kept"
        )
        stamps.append(middle.stat(marker_path("x")).mtime)
    assert stamps[0] == stamps[1] == stamps[2], f"copied again: {stamps}"
    new_process()
    assert restored(config_, "x") == (2.0, "local"), "the newer commit is the one restored"
    new_process()
