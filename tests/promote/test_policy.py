"""Promotion and retention rules, table-driven: pure functions of a catalog."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tierstore.config import config_from_dict
from tierstore.promote.policy import (
    Copy,
    Deletion,
    Promotion,
    Rules,
    TierRules,
    every_for,
    promotions,
    retention,
)
from tierstore.promote.rules import rules_of


def config(*tiers: dict[str, Any], every: int = 1) -> Rules:
    """The rules of a configuration with these tiers (YAML fields, read as the promoter reads them)."""
    specs = []
    for index, extra in enumerate(tiers):
        kind = extra.pop("type", "shared" if index else "memory")
        spec = {"name": f"t{index}", "type": kind, **extra}
        if kind != "s3":
            spec.setdefault("path", f"/tmp/unused-{index}")
        else:
            spec.setdefault("url", "s3://bucket/x")
        specs.append(spec)
    return rules_of(config_from_dict({"tiers": specs, "promote": {"every": every}}, check_paths=False))


def copies(*seqs: int) -> dict[str, Copy]:
    return {f"step_{s:04d}": Copy(f"step_{s:04d}", s, s, float(s), f"g{s:010x}") for s in seqs}


def ids(items: list[Any]) -> list[str]:
    return sorted(f"{i.checkpoint_id}@{getattr(i, 'target', getattr(i, 'tier', ''))}" for i in items)


def test_every_defaults() -> None:
    cfg = config({}, {}, {"every": 3}, {}, every=5)
    assert [every_for(cfg, i) for i in range(4)] == [1, 1, 3, 5]


CASCADE = [
    # (tier specs, promote.every, catalog, expected promotions "id@target")
    ([{}, {}], 1, {"t0": copies(1, 2)}, ["step_0001@t1", "step_0002@t1"]),
    ([{}, {}], 2, {"t0": copies(1, 2, 3, 4)}, ["step_0002@t1", "step_0004@t1"]),
    # the middle tier gets everything first; the last tier waits for it
    ([{}, {}, {}], 2, {"t0": copies(1, 2)}, ["step_0001@t1", "step_0002@t1"]),
    ([{}, {}, {}], 2, {"t0": copies(2), "t1": copies(2)}, ["step_0002@t2"]),
    # a middle tier that does not take it: the last tier copies from the nearest tier holding it
    ([{}, {"every": 2}, {"every": 3}], 1, {"t0": copies(3)}, ["step_0003@t2"]),
    # nothing is promoted that the target's retention would delete at once
    ([{}, {"keep": 2}], 1, {"t0": copies(1, 2, 3)}, ["step_0002@t1", "step_0003@t1"]),
    ([{}, {"keep": 2}], 1, {"t0": copies(1), "t1": copies(5, 6)}, []),
    ([{}, {"keep": 1, "pin": ["step_0001"]}], 1, {"t0": copies(1, 2)}, ["step_0001@t1", "step_0002@t1"]),
    # already there: nothing to do
    ([{}, {}], 1, {"t0": copies(1), "t1": copies(1)}, []),
    # a checkpoint without seq only flows where every == 1
    ([{}, {}], 2, {"t0": {"x": Copy("x", None, None, 1.0, "g0000000001")}}, []),
]


@pytest.mark.parametrize(("tiers", "every", "catalog", "expected"), CASCADE)
def test_promotions(tiers: list[dict[str, Any]], every: int, catalog: Any, expected: list[str]) -> None:
    planned = promotions(config(*[dict(t) for t in tiers], every=every), catalog)
    assert ids(planned) == sorted(expected)
    assert all(isinstance(p, Promotion) for p in planned)


RETENTION = [
    # keep N newest
    ([{"keep": 2}], {"t0": copies(1, 2, 3)}, set(), ["step_0001@t0"]),
    # no keep: keep everything
    ([{}], {"t0": copies(1, 2, 3)}, set(), []),
    # keep_every milestones survive
    ([{"keep": 1, "keep_every": 2}], {"t0": copies(1, 2, 3, 4, 5)}, set(), ["step_0001@t0", "step_0003@t0"]),
    # pins survive
    ([{"keep": 1, "pin": ["step_0001"]}], {"t0": copies(1, 2, 3)}, set(), ["step_0002@t0"]),
    # the newest is never deleted, even with keep: 1 and in use elsewhere
    ([{"keep": 1}], {"t0": copies(7)}, set(), []),
    # waiting for promotion to the next tier: kept
    ([{"keep": 1}, {}], {"t0": copies(1, 2)}, set(), []),
    ([{"keep": 1}, {}], {"t0": copies(1, 2), "t1": copies(1, 2)}, set(), ["step_0001@t0"]),
    # not selected for the next tier (every 2): not waiting, so deletable
    ([{"keep": 1}, {}], 2, set(), None),
    # in use (a reader holds a lease): kept
    ([{"keep": 1}], {"t0": copies(1, 2, 3)}, {"step_0001"}, ["step_0002@t0"]),
    # the last durable copy of a checkpoint another tier keeps is not deleted
    ([{"keep": 5}, {"keep": 1}], {"t0": copies(1, 2), "t1": copies(1, 2)}, set(), []),
    # ...but a durable copy is deletable when another durable tier keeps it
    (
        [{"keep": 5}, {"keep": 1}, {"keep": 5}],
        {"t0": copies(1, 2), "t1": copies(1, 2), "t2": copies(1, 2)},
        set(),
        ["step_0001@t1"],
    ),
]


@pytest.mark.parametrize(("tiers", "catalog", "in_use", "expected"), RETENTION)
def test_retention(tiers: list[dict[str, Any]], catalog: Any, in_use: set[str], expected: Any) -> None:
    if expected is None:  # the every-2 case: tier 1 only takes even seqs
        cfg = config({"keep": 1}, {}, every=2)
        catalog = {"t0": copies(1, 2, 3), "t1": copies(2)}
        assert ids(retention(cfg, catalog)) == ["step_0001@t0", "step_0002@t0"]
        return
    decided = retention(config(*[dict(t) for t in tiers]), catalog, frozenset(in_use))
    assert ids(decided) == sorted(expected)
    assert all(isinstance(d, Deletion) and d.reason.startswith("beyond keep") for d in decided)


def test_a_part_whose_commit_a_node_cannot_see_waits_only_so_long() -> None:
    cfg = config({"type": "memory", "keep": 1}, {}, every=1)
    part = {
        i: Copy(i, s, s, 1000.0, "g0000000001", partial=True) for i, s in (("step_0001", 1), ("step_0002", 2))
    }
    young = retention(cfg, {"t0": part}, now=1000.0 + 60)
    assert young == [], "within stale_after it may still commit elsewhere: kept for promotion"
    old = retention(cfg, {"t0": part}, now=1000.0 + cfg.stale_after + 1)
    assert ids(old) == ["step_0001@t0"], "a failed save's part is released (beyond keep)"
    confirmed = {i: dataclasses.replace(c, confirmed=True) for i, c in part.items()}
    held = retention(cfg, {"t0": confirmed}, now=1000.0 + cfg.stale_after + 1)
    assert held == [], "a part of a save known committed waits for promotion like any commit"
    promoted = {
        "t0": confirmed,
        "t1": {i: dataclasses.replace(c, partial=False, source="t0") for i, c in confirmed.items()},
    }
    assert ids(retention(cfg, promoted, now=1000.0 + cfg.stale_after + 1)) == ["step_0001@t0"]


def test_a_refusing_middle_tier_is_routed_around_but_the_durable_tier_is_waited_for() -> None:
    cfg = config({"keep": 1}, {"type": "local"}, {"type": "s3"})
    held = {"t0": copies(1, 2)}
    assert ids(promotions(cfg, held)) == ["step_0001@t1", "step_0002@t1"], "t2 waits for t1"
    routed = promotions(cfg, held, frozenset({"t1"}))
    assert ids(routed) == ["step_0001@t1", "step_0001@t2", "step_0002@t1", "step_0002@t2"]
    assert all(p.source == "t0" for p in routed), "copied from the nearest tier above holding it"
    held_after = {"t0": copies(1, 2), "t2": copies(1, 2)}
    assert ids(retention(cfg, held_after)) == [], "t0 keeps step 1 for t1 while t1 is healthy"
    assert ids(retention(cfg, held_after, unavailable=frozenset({"t1"}))) == ["step_0001@t0"]
    assert ids(retention(cfg, {"t0": copies(1, 2)}, unavailable=frozenset({"t2"}))) == [], (
        "nothing leaves host memory while the durable tier refuses it"
    )


def test_the_rules_of_a_configuration_are_its_tiers_yaml_fields() -> None:
    rules = config({"keep": 2, "pin": ["a"]}, {"keep_every": 10, "every": 3}, every=5)
    assert rules.tiers == (
        TierRules("t0", node_local=True, keep=2, pin=("a",)),
        TierRules("t1", keep_every=10, every=3),
    )
    assert rules.durable_every == 5 and rules.stale_after == 3600.0


def test_the_policy_is_pure_it_imports_no_configuration() -> None:
    import ast
    import inspect

    from tierstore.promote import policy

    imported = {
        node.module
        for node in ast.walk(ast.parse(inspect.getsource(policy)))
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= {"__future__", "collections.abc", "dataclasses", "tierstore.ids"}, imported


def test_a_copy_overwritten_in_a_lower_tier_is_not_promoted_into_the_tiers_between() -> None:
    """Found by the model: x saved fast (seq 1), then overwritten straight into the durable tier
    (seq 2). Promoting the fast copy into the middle tier would leave there a copy that only the
    durable tier's marker shows stale: with host memory lost and the durable tier away, a new
    process could serve it."""
    cfg = config({}, {}, {})
    older = Copy("x", 1, 1, 1.0, "g0000000001")
    newer = Copy("x", 2, 1, 2.0, "g0000000002")
    assert promotions(cfg, {"t0": {"x": older}, "t2": {"x": newer}}) == []
    assert ids(promotions(cfg, {"t0": {"x": newer}, "t2": {"x": older}})) == ["x@t1"]


def test_a_part_is_not_judged_stale_by_its_planned_number() -> None:
    """A node's unconfirmed part of a multi-node save carries the number planned, not its final
    one: a commit of the id elsewhere with a higher number says nothing about it."""
    cfg = config({"type": "memory"}, {"type": "local"}, {})
    part = Copy("x", 1, 1, 1.0, "g0000000001", partial=True)
    newer = Copy("x", 2, 1, 2.0, "g0000000002")
    assert ids(promotions(cfg, {"t0": {"x": part}, "t2": {"x": newer}})) == ["x@t1"]


def _x(seq: int, **fields: Any) -> Copy:
    return Copy("x", seq, 1, float(seq), f"g{seq:010x}", **fields)


def test_a_copy_an_overwrite_replaced_in_another_tier_is_deleted_whatever_the_keep_rules() -> None:
    """Found by the model: x in the middle tier, then overwritten straight into the durable tier.
    The middle tier's copy is the newest it holds, so keep rules kept it; with the durable tier
    away and host memory lost (the sightings that knew better), a new process served it."""
    cfg = config({}, {}, {})
    held = {"t1": {"x": _x(1)}, "t2": {"x": _x(2, overwrite=True)}}
    assert [(d.tier, d.generation) for d in retention(cfg, held)] == [("t1", _x(1).generation)]
    assert "tier t2 holds a newer commit" in retention(cfg, held)[0].reason


@pytest.mark.parametrize(
    "newer",
    [
        _x(2, overwrite=False),  # saved without overwrite while t1 held x: two contents, both kept
        _x(2, overwrite=True, unseen_tiers=frozenset({"t1"})),  # it could not see t1's copy
        _x(2, overwrite=True, conflicts=frozenset({"t1"})),  # a conflict already recorded
        _x(2, overwrite=True, partial=True),  # a part's planned number says nothing
    ],
)
def test_a_newer_commit_that_did_not_replace_knowingly_deletes_nothing(newer: Copy) -> None:
    cfg = config({}, {}, {})
    assert retention(cfg, {"t1": {"x": _x(1)}, "t2": {"x": newer}}) == []


def test_an_overtaken_copy_in_use_is_kept() -> None:
    cfg = config({}, {}, {})
    held = {"t1": {"x": _x(1)}, "t2": {"x": _x(2, overwrite=True)}}
    assert retention(cfg, held, frozenset({"x"})) == []


def test_a_copy_below_the_overwrite_waits_for_its_promotion() -> None:
    """x overwritten in the fast tier: the durable tier's older copy stays the durable one until
    the newer commit's promotion replaces it there."""
    cfg = config({}, {}, {})
    held = {"t0": {"x": _x(2, overwrite=True)}, "t2": {"x": _x(1)}}
    assert retention(cfg, held) == []


@pytest.mark.parametrize("rule", [{"pin": ["x"]}, {"keep_every": 1}])
def test_an_overtaken_copy_is_deleted_although_pinned_or_a_milestone(rule: dict[str, Any]) -> None:
    """Decided in review: pin and keep_every keep an id, whose content is now the overwrite's; the
    replaced content kept would be served once the slower tier is away and host memory lost.
    docs/operations.md says to pin the id where the overwrite went."""
    cfg = config(dict(rule), {}, {})
    held = {"t0": {"x": _x(1)}, "t2": {"x": _x(2, overwrite=True)}}
    assert [(d.tier, d.generation) for d in retention(cfg, held)] == [("t0", _x(1).generation)]


@pytest.mark.parametrize(
    "newer",
    [
        _x(2, overwrite=False),  # saved without overwrite while t0 held x: a conflict, both kept
        _x(2, overwrite=True, unseen_tiers=frozenset({"t0"})),  # it could not see t0's copy
    ],
)
def test_a_content_in_conflict_with_a_newer_number_still_goes_down_the_tiers(newer: Copy) -> None:
    """Found in review of ad993c0: a content that a higher-numbered commit did not knowingly
    replace (two savers raced, or one could not see it) is one side of a conflict an operator
    settles; it reaches the middle tier like any copy, rather than living in host memory only."""
    cfg = config({}, {}, {})
    held = {"t0": {"x": _x(1, conflicts=frozenset({"t2"}))}, "t2": {"x": newer}}
    assert ids(promotions(cfg, held)) == ["x@t1"]
