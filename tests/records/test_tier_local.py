"""Tiers stand alone, across processes: sequences of real events, through the public API, found by
an adversarial review of the tier-local protocol (each failed on the code it was written against).

"Another process" is simulated by forgetting this process's knowledge of the other tiers (what a
fresh process has: nothing read at start-up, no own commits), ``tierstore.records.known._KNOWN``;
a wiped node by removing its memory tier's directory; an outage or a request count by the review's
own tier type (:mod:`tests.records.watched_tier`, a shared directory that counts its verbs).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.local_files import real_path
from tests.records import watched_tier
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.ids import sighting_path
from tierstore.promote.sidecar import Promoter
from tierstore.records import known
from tierstore.records.conflicts import read_conflicts
from tierstore.records.marker import read_manifest
from tierstore.records.sightings import Sighting, record_sighting
from tierstore.signing import MarkerTrust


def state(value: float) -> dict[str, Any]:
    return {"w": torch.full((256,), value)}


def save(config: Config, checkpoint_id: str, value: float, **writer: Any) -> None:
    dcp.save(state(value), storage_writer=TieredWriter(config, **writer), checkpoint_id=checkpoint_id)


def restored(config: Config, checkpoint_id: str) -> tuple[float, str | None]:
    target = state(-1.0)
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    assert torch.equal(target["w"], torch.full((256,), float(target["w"][0])))
    return float(target["w"][0]), reader.chosen_tier


def new_process() -> None:
    """What a process started now knows of the other tiers: nothing yet."""
    known._KNOWN.get().clear()


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    new_process()
    watched_tier.DOWN.clear()
    yield
    watched_tier.DOWN.clear()
    new_process()


def calls(config: Config, name: str) -> int:
    return watched_tier.CALLS[config.make_tier(name, node=0).root]


def test_a_tier_overwrite_by_another_process_is_restored_once_the_promoter_has_sighted_it(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 3 (a restore never serves an older generation of an id when a newer one is
    committed anywhere, including via ``tier=`` saves).

    1. process A saves ``final`` (1.0) into memory; the promoter copies it to local and leaves its
       sighting of local in memory;
    2. process B saves ``final`` again (2.0) straight into local: ``tier="local", overwrite=True``
       (local now holds only the new generation, at a higher commit number);
    3. process C (a restart, seconds later: the sighting is well within its trust period) restores
       ``final``.

    Found by review: the restore trusted the sighting, which did not know of B's commit, and served
    1.0 from memory. That is the documented window (docs/operations.md, "While a tier is away"): a
    save made straight into a slower tier is seen by other processes once the promoter has sighted
    it. This test holds the window shut after that pass."""
    config = make_config("memory", "local")
    save(config, "final", 1.0)
    Promoter(config, node=0).run_once()
    new_process()
    save(config, "final", 2.0, tier="local", overwrite=True)
    assert read_manifest(config.make_tier("local", node=0), "final", trust=MarkerTrust()).seq == 2
    Promoter(config, node=0).run_once()  # the sidecar's next pass
    new_process()
    assert restored(config, "final") == (2.0, "local")


def test_latest_finds_a_newer_id_another_process_saved_with_tier_once_sighted(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 3 (latest_committed returns the newest restorable checkpoint, ``tier=`` saves
    included).

    1. process A saves ``step_1`` into memory; the promoter sights local;
    2. process B saves ``final`` straight into local (``tier="local"``): commit 2, restorable;
    3. process C (a restart) asks ``latest_committed``.

    Found by review: within the window (before the promoter's next pass) ``step_1`` was answered;
    after the pass, ``final``."""
    config = make_config("memory", "local")
    save(config, "step_1", 1.0)
    Promoter(config, node=0).run_once()
    new_process()
    save(config, "final", 2.0, tier="local")
    Promoter(config, node=0).run_once()  # the sidecar's next pass
    new_process()
    assert latest_committed(config, collective=False) == "final"


def test_latest_goes_back_to_the_old_timeline_once_an_unreachable_tier_returns(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 3 (newest = commit order, robust to a wiped first tier; latest_committed returns
    the newest restorable checkpoint).

    1. a job saves ``old_1`` .. ``old_5`` (commits 1..5); the promoter copies them to the durable
       tier;
    2. the node is replaced (its memory tier is empty) and the durable tier is unreachable when the
       new job starts: ``latest_committed`` is None, the job saves ``new_1`` into memory (commit 1:
       nothing it can see knows of 2..5; its marker says the durable tier was unseen);
    3. the durable tier returns; the promoter runs (copies ``new_1`` down); the job restarts.

    Expected ``new_1``, the last commit made. Found by review: ``old_5``, because ``new_1`` kept
    commit number 1 everywhere (the durable tier's log then had two entries numbered 1), so the
    restart resumed the abandoned timeline. A process blind to a tier now numbers its commits far
    above everything it knows (records/known.py, ``BLIND_JUMP``)."""
    config = make_config("memory", "watched", probe_timeout="1s")
    memory, durable = config.make_tiers(node=0)
    for step in range(1, 6):
        save(config, f"old_{step}", float(step))
    Promoter(config, node=0).run_once()
    shutil.rmtree(memory.root)  # the node is replaced
    new_process()
    watched_tier.DOWN.add(durable.root)
    assert latest_committed(config, collective=False) is None
    save(config, "new_1", 11.0)
    assert read_manifest(memory, "new_1", trust=MarkerTrust()).unseen_tiers == ("watched",)
    watched_tier.DOWN.clear()
    Promoter(config, node=0).run_once()
    new_process()
    assert latest_committed(config, collective=False) == "new_1"


def test_a_save_into_memory_asks_the_durable_tier_after_the_processs_first_save(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 1 (a save into tier T makes no request to any other tier after its process's first
    save).

    1. a process's first save goes straight to the durable tier (``tier=``, e.g. an initial
       checkpoint); its start-up look lists memory;
    2. its next save goes to memory, as usual.

    Expected: the memory save asks nothing of the durable tier. Found by review: it listed the durable tier's
    commit log and markers (the start-up look skipped the first save's own target, and looks at it
    now); during an outage of that tier, this save waits for ``probe_timeout`` and marks it unseen.
    """
    config = make_config("memory", "watched")
    save(config, "init", 0.0, tier="watched")
    before = calls(config, "watched")
    save(config, "step_1", 1.0)
    assert calls(config, "watched") == before, "the memory save made requests to the durable tier"


def test_latest_after_a_vetoed_save_asks_the_sighted_durable_tier(make_config: Callable[..., Config]) -> None:
    """Guarantee 4 (restores and latest_committed from the fastest tier make no requests to slower
    tiers that the promoter has sighted).

    1. ``s1``, ``s2`` are saved into memory; the promoter copies them down and sights the durable
       tier;
    2. a save of ``s3`` is vetoed (``check_finite``: a NaN): it claimed commit 3 in memory's log,
       and that entry stays (a log's highest entry is never removed);
    3. the job restarts and asks ``latest_committed``.

    Expected ``s2``, with no request to the sighted durable tier. Actual ``s2``, after reading the
    durable tier's marker of ``s3`` (the catalog looks for the vetoed generation "elsewhere"): during
    an outage the restart waits there for ``probe_timeout``."""
    config = make_config("memory", "watched")
    save(config, "s1", 1.0)
    save(config, "s2", 2.0)
    Promoter(config, node=0).run_once()
    with pytest.raises(BaseException, match=r"NaN|nan|finite"):
        save(config, "s3", float("nan"), check_finite=True)
    new_process()
    before = calls(config, "watched")
    assert latest_committed(config, collective=False) == "s2"
    assert calls(config, "watched") == before, "latest_committed asked the sighted durable tier"


def test_a_deleted_id_is_refused_from_a_sighting_recorded_before_retention(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 2, its converse (an id committed in any tier is refused: known from start-up,
    sightings, own commits): an id committed nowhere must not be refused.

    1. ``a`` is saved and promoted to local; ``b``, ``c`` are saved; with ``keep: 1`` in both tiers,
       the next promoter pass promotes ``c`` and its retention deletes ``a`` from local (and
       ``a``, ``b`` from memory);
    2. a new process saves ``a`` (its start-up look lists local: no ``a`` there).

    Expected: the save commits (``a`` exists in no tier). Actual: CheckpointExistsError "already
    committed in tier local": the pass recorded its sighting of local before its retention ran, and
    the save believes the sighting over its own, newer, start-up look."""
    config = make_config("memory", "local", tiers={"memory": {"keep": 1}, "local": {"keep": 1}})
    memory, local = config.make_tiers(node=0)
    save(config, "a", 1.0)
    Promoter(config, node=0).run_once()
    save(config, "b", 2.0)
    save(config, "c", 3.0)
    Promoter(config, node=0).run_once()
    assert not memory.exists("a/commit.json") and not local.exists("a/commit.json")
    new_process()
    save(config, "a", 4.0)
    assert restored(config, "a") == (4.0, "memory")


def test_an_id_saved_while_the_durable_tier_was_away_is_kept_beside_the_other_content(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 2 holds: ``a`` (1.0) durable; node replaced and the durable tier away at start-up;
    ``a`` saved again (2.0) into memory; the tier returns: the promoter records a conflict, keeps
    both contents, and retention (keep 1 in memory) keeps the conflicted copy through later saves."""
    config = make_config("memory", "watched", probe_timeout="1s", tiers={"memory": {"keep": 1}})
    memory, durable = config.make_tiers(node=0)
    save(config, "a", 1.0)
    Promoter(config, node=0).run_once()
    shutil.rmtree(memory.root)
    new_process()
    watched_tier.DOWN.add(durable.root)
    save(config, "a", 2.0)
    watched_tier.DOWN.clear()
    Promoter(config, node=0).run_once()
    assert [c.checkpoint_id for c in read_conflicts(memory)] == ["a"]
    save(config, "b", 3.0)
    save(config, "c", 4.0)
    Promoter(config, node=0).run_once()
    gen_memory = read_manifest(memory, "a", trust=MarkerTrust()).generation
    gen_durable = read_manifest(durable, "a", trust=MarkerTrust()).generation
    assert gen_memory != gen_durable
    assert restored(config, "c")[0] == 4.0


def test_an_overwrite_racing_a_promotion_never_leaves_the_old_generation_served(
    make_config: Callable[..., Config],
) -> None:
    """Guarantee 3 holds within one process: ``a`` promoted to local, then overwritten in memory;
    restores serve the new generation before and after the next pass."""
    config = make_config("memory", "local")
    save(config, "a", 1.0)
    Promoter(config, node=0).run_once()
    save(config, "a", 2.0, overwrite=True)
    assert restored(config, "a") == (2.0, "memory")
    Promoter(config, node=0).run_once()
    new_process()
    assert restored(config, "a")[0] == 2.0


def test_an_old_sighting_of_a_newer_commit_counts_only_while_its_tier_does_not_answer(
    make_config: Callable[..., Config],
) -> None:
    """A sighting too old to trust (no promoter running) still says the durable tier once held a
    newer commit of ``x``. Asked, the durable tier answers for itself: it holds no ``x`` now (an
    operator dropped that content), and memory's ``x`` is served. Away, it cannot: the older
    content is not served over the commit the sighting saw (host memory lost, the durable tier
    away: docs/operations.md)."""
    config = make_config("memory", "watched", probe_timeout="1s")
    memory, durable = config.make_tiers(node=0)
    save(config, "x", 1.0)
    record_sighting(memory, Sighting("watched", 2, {"x": (2, "g0000000000020000000")}))
    hour_ago = time.time() - 3600
    os.utime(str(real_path(memory, sighting_path("watched"))), (hour_ago, hour_ago))
    new_process()
    assert restored(config, "x") == (1.0, "memory")
    watched_tier.DOWN.add(durable.root)
    new_process()
    with pytest.raises(CheckpointException, match="older than g0000000000020000000"):
        restored(config, "x")
