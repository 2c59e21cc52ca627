"""The promoter's duties that decide something, table by table: the plans (promotion, retention) on
views built by hand, the conflicts and the part numbers on the tests' dict tiers
(``tests/tiers/dict_tier.py``), each duty run alone on a view the look made."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tierstore.config import Config, config_from_dict
from tierstore.ids import checkpoint_file, intent_path, marker_path, rank_part_path
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.duties import Context, conflicts, promote, retain
from tierstore.promote.duties.confirm import ConfirmNumbers
from tierstore.promote.metrics import PromoterMetrics
from tierstore.promote.policy import Copy, Promotion, Rules, TierRules
from tierstore.promote.view import View, first_view, look
from tierstore.promote.views import TierViews
from tierstore.records.conflicts import Conflict, read_conflicts, record_conflict
from tierstore.records.marker import FileEntry, Manifest
from tierstore.records.parts import PartRecord, part_records
from tierstore.records.protocol import publish, record_parts
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier


def gen(n: int) -> str:
    return f"g{n:011d}aaaaaaaa"


def seen(
    checkpoint_id: str, seq: int, *, partial: bool = False, confirmed: bool = True, **copy: Any
) -> SeenCopy:
    parts = (
        (PartRecord(checkpoint_id, gen(seq), 1, (1,), (), seq=seq, confirmed=confirmed),) if partial else ()
    )
    made = Copy(checkpoint_id, seq, seq, 1e9 + seq, gen(seq), partial=partial, confirmed=confirmed, **copy)
    return SeenCopy(made, None, parts)


def view(found: dict[str, list[SeenCopy]], owned: str = "fast shared durable", **rest: Any) -> View:
    held = {name: {s.copy.checkpoint_id: s for s in copies} for name, copies in found.items()}
    return View(frozenset(owned.split()), held, **rest)


RULES = Rules((TierRules("fast", node_local=True, keep=1), TierRules("shared"), TierRules("durable")))

PLANS = [
    (
        "a commit goes one tier down",
        view({"fast": [seen("a", 1)], "shared": [], "durable": []}),
        ["a fast->shared"],
    ),
    (
        "then the next",
        view({"fast": [seen("a", 1)], "shared": [seen("a", 1)], "durable": []}),
        ["a shared->durable"],
    ),
    (
        "a job-wide source another node looks after",
        view({"fast": [], "shared": [seen("a", 1)], "durable": []}, owned="fast"),
        [],
    ),
    (
        "a middle tier that cannot be listed is routed around",
        view({"fast": [seen("a", 1)], "durable": []}, unreachable={"shared": "down"}),
        ["a fast->durable"],
    ),
    (
        "a last tier that cannot be listed",
        view({"fast": [seen("a", 1)], "shared": [seen("a", 1)]}, unreachable={"durable": "down"}),
        [],
    ),
    ("a source that cannot be listed", view({"shared": [], "durable": []}, unreachable={"fast": "down"}), []),
    (
        "a middle tier refusing writes is tried again, and routed around",
        view({"fast": [seen("a", 1)], "shared": [], "durable": []}, unavailable=frozenset({"shared"})),
        ["a fast->shared", "a fast->durable"],
    ),
    (
        "a copy in conflict below stays",
        view(
            {"fast": [seen("a", 1, conflicts=frozenset({"shared"}))], "shared": [seen("a", 2)], "durable": []}
        ),
        ["a shared->durable"],
    ),
]


@pytest.mark.parametrize(("case", "given", "expected"), PLANS, ids=[c[0] for c in PLANS])
def test_promote_plans(case: str, given: View, expected: list[str]) -> None:
    planned = promote.plan(given, RULES)
    assert [f"{p.checkpoint_id} {p.source}->{p.target}" for p in planned] == expected, case


BOTH = {"shared": [seen("a", 1), seen("b", 2)], "durable": [seen("a", 1), seen("b", 2)]}

RETENTION = [
    ("beyond keep: 1", view({"fast": [seen("a", 1), seen("b", 2)], **BOTH}), set(), ["fast a"]),
    ("an id in use", view({"fast": [seen("a", 1), seen("b", 2)], **BOTH}), {"a"}, []),
    (
        "a tier another node looks after",
        view({"fast": [seen("a", 1), seen("b", 2)], **BOTH}, owned="shared"),
        set(),
        [],
    ),
    (
        "a copy in conflict below",
        view({"fast": [seen("a", 1, conflicts=frozenset({"shared"})), seen("b", 2)], **BOTH}),
        set(),
        [],
    ),
    ("not below yet", view({"fast": [seen("a", 1), seen("b", 2)], "shared": [], "durable": []}), set(), []),
    (
        "a part whose number is confirmed",
        view({"fast": [seen("a", 1, partial=True), seen("b", 2)], **BOTH}),
        set(),
        ["fast a"],
    ),
    (
        "a part whose number is not confirmed yet",
        view({"fast": [seen("a", 1, partial=True, confirmed=False), seen("b", 2)], **BOTH}),
        set(),
        [],
    ),
]


@pytest.mark.parametrize(("case", "given", "in_use", "expected"), RETENTION, ids=[c[0] for c in RETENTION])
def test_retention_plans(case: str, given: View, in_use: set[str], expected: list[str]) -> None:
    planned = retain.plan(given, RULES, frozenset(in_use))
    assert [f"{d.tier} {d.checkpoint_id}" for d in planned] == expected, case


@pytest.fixture
def config() -> Iterator[Config]:
    run = uuid.uuid4().hex[:8]
    yield config_from_dict(
        {
            "tiers": [
                {"name": "fast", "type": "nodedict", "store": f"fast-{run}-{{node}}"},
                {"name": "durable", "type": "dict", "store": f"durable-{run}"},
            ]
        }
    )


def commit(tier: Tier, checkpoint_id: str, n: int, *, seq: int | None = None, **marker: Any) -> Manifest:
    """A committed copy of generation ``gen(n)`` (commit ``seq``, default ``n``) with one file."""
    tier.write_bytes(checkpoint_file(checkpoint_id, f"{gen(n)}/r0"), b"x" * 8)
    made = Manifest(checkpoint_id, gen(n), 1, (FileEntry(f"{gen(n)}/r0", 8, 0),), seq=seq or n, **marker)
    assert publish(tier, made, replace=False, trust=MarkerTrust()) is None
    return made


def context(config: Config, node: int = 0) -> Context:
    return Context(config, node, PromoterMetrics())


def looked(ctx: Context) -> View:
    return look(ctx, TierViews(0.0), first_view(ctx))


CONFLICTS = [
    # (case, fast's marker fields, durable's generation, recorded)
    ("the save could not see the durable tier", {"unseen_tiers": ("durable",)}, 1, True),
    ("a newer overwrite that saw it", {"overwrite": True, "seq": 3}, 1, False),
    ("saved without overwrite while it held another", {"overwrite": False, "seq": 3}, 1, True),
    ("the same content", {}, 2, False),
]


@pytest.mark.parametrize(("case", "marker", "below", "recorded"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_conflicts_are_recorded_and_kept_by_this_pass(
    config: Config, case: str, marker: dict[str, Any], below: int, recorded: bool
) -> None:
    ctx = context(config)
    fast, durable = ctx.tiers
    commit(durable, "x", below)
    commit(fast, "x", 2, **marker)
    outcome = conflicts.run(looked(ctx), ctx)
    assert outcome.view is not None
    expected = {"durable"} if recorded else set()
    assert outcome.view.found["fast"]["x"].copy.conflicts == expected, case
    assert [c.target for c in read_conflicts(fast)] == sorted(expected), case
    assert [c.target for c in outcome.view.conflicts["fast"]] == sorted(expected), case
    assert ctx.metrics.registry.get_sample_value("tierstore_conflicts", {"tier": "fast"}) == len(expected)


def test_a_conflict_whose_copy_was_replaced_is_settled(config: Config) -> None:
    ctx = context(config)
    fast, durable = ctx.tiers
    commit(durable, "x", 1)
    commit(fast, "x", 2)
    stale = Conflict("x", gen(9), 9, "durable", gen(1), 1, "an older content, dropped since")
    assert record_conflict(fast, stale)
    outcome = conflicts.run(looked(ctx), ctx)
    assert outcome.view is not None and outcome.view.conflicts["fast"] == ()
    assert read_conflicts(fast) == []


def leave_part(tier: Tier, checkpoint_id: str, n: int, seq: int) -> None:
    """Node 1's part (rank 1) of a save the coordinator's node committed, with its planned number."""
    record = PartRecord(checkpoint_id, gen(n), 1, (1,), (), seq=seq, node_ranks=(1,))
    record_parts(tier, checkpoint_id, [(rank_part_path(checkpoint_id, gen(n), 1), record.to_json())])


NUMBERS = [
    # (case, what the durable tier holds of x, the part's number afterwards, confirmed)
    ("the marker names the part's generation", "marker", 5, True),
    ("the marker names another generation", "other", 3, False),
    ("the coordinator's committed manifest", "intent", 4, True),
    ("nothing yet", "", 3, False),
]


@pytest.mark.parametrize(("case", "durable_holds", "seq", "confirmed"), NUMBERS, ids=[c[0] for c in NUMBERS])
def test_part_numbers_are_confirmed_from_a_job_wide_tier(
    config: Config, case: str, durable_holds: str, seq: int, confirmed: bool
) -> None:
    ctx = context(config, node=1)
    fast, durable = ctx.tiers
    leave_part(fast, "x", 7, seq=3)
    if durable_holds == "marker":
        commit(durable, "x", 7, seq=5)
    elif durable_holds == "other":
        commit(durable, "x", 8, seq=6)
    elif durable_holds == "intent":
        manifest = Manifest("x", gen(7), 2, (), seq=4)
        durable.write_bytes(intent_path("x", gen(7)), manifest.to_json())
    before = looked(ctx)
    assert before.found["fast"]["x"].copy.seq == 3
    outcome = ConfirmNumbers().run(before, ctx)
    (record,) = part_records(fast, "x")[gen(7)]
    assert (record.seq, record.confirmed) == (seq, confirmed), case
    if confirmed:  # listed again: the copy ranks by its final number, the kept listing is stale
        assert outcome.view is not None and outcome.view.found["fast"]["x"].copy.seq == seq
        assert outcome.forget == {"fast"}
    else:
        assert outcome.view is None and outcome.forget == frozenset()


def test_a_copy_seen_through_an_index_that_its_marker_has_moved_past_is_listed_again(config: Config) -> None:
    """A keeper's index named generation 1 of ``x``; the marker, read when the promotion starts,
    names generation 2 (an overwrite since the index). The promotion must not go on with
    generation 1's name (its activity record and parts would name a generation it does not copy):
    it forgets the source's listing, and the next look sees generation 2 as it is."""
    ctx = context(config)
    fast, durable = ctx.tiers
    commit(durable, "x", 2)
    looked(ctx)  # takes the job-wide tier's lease, as a keeper's pass does
    behind = view({"fast": [], "durable": [seen("x", 1)]}, owned="fast durable")
    assert behind.found["durable"]["x"].manifest is None  # as an index row has it
    outcome = promote.run(Promotion("x", "durable", "fast"), behind, ctx)
    assert (outcome.forget, outcome.promoted, outcome.failed) == ({"durable"}, (), ())
    assert not fast.exists(marker_path("x")), "promoted under the index's generation"
