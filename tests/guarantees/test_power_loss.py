"""Power loss at every operation of a file tier (issue 24, item 2).

A run of saves and promoter passes into a ``local`` tier and a ``shared`` tier, both directories on
one machine (a power cut takes both), is recorded by :class:`tests.power_loss.OsRecorder`: a layer
around the ``os`` calls, nothing in tierstore is patched. For every operation of the trace the
power-cut crash state after it is rebuilt in a fresh directory (the model and what it leaves out are
in :mod:`tests.power_loss`: data not fsynced reverted, directory entries not fsynced dropped), and
the oracle of issue 24 is checked against that directory:

(a) ``latest_committed`` names a checkpoint at least as new as the last one whose ``dcp.save``
    returned before the cut, and ``dcp.load`` of it with ``TieredReader`` yields one of the states
    saved under that id, bit-exact, from that save or a later one;
(b) no marker stands over missing, short or corrupt data (:func:`tierstore.cli.audit.audit_all`);
(c) with ``check_after``: a fresh save and a promoter pass (promotion, retention, gc) in the crash
    state succeed, and the fresh save is then the latest, loadable bit-exact.

The fixed run (``make test``): two saves, a promoter pass, a third save, an overwrite of the second
id (a new generation, newer than the third), and a pass whose retention deletes the first
checkpoint from both tiers (``keep: 2``) and whose gc runs (a cut leaves only fresh leftovers,
which gc must leave alone: removing stale ones is not exercised here); every conservative crash
state, (c) on every fourth. The sweep (``make faults``; ``make test`` runs its first seed): one random run of
3 to 6 steps per seed, every crash state with its variants (directories flushed, write prefixes),
(c) on each. Even seeds save to a ``memory`` tier first, which a power cut empties: there a save
must survive only once a promoter pass begun after it has finished (it is on the local disk then),
and a fresh save after the cut must still be newer than what the disk tiers hold. Crash states
equal byte for byte (with the same saves returned before them) are checked once; the counts
printed are of distinct states ("S crash states, S passed").

The sweep found one bug (seed 0): a promotion logs its commit number after publishing the marker,
and a cut between the two left a marker the log did not know; with host memory emptied, the next
save took that number again and did not rank newest (tests/records/test_known_unlogged.py).

Each rank's IO must go through this process for the recorder to see it: the runs are single-rank
and in-process (multi-rank saves, SIGKILL and the S3 tier are items 1 and 3 of the issue).
"""

from __future__ import annotations

import copy
import functools
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from tests.power_loss import CrashState, OsRecorder, Trace, materialise, tmpfs_dir, tree_digest
from tests.seeds import fault_seeds
from tests.training import Trainer, assert_same, fresh_target
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.cli.audit import audit_all
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter

Step = tuple[str, int, bool] | None
"""``(id, seed of the state, overwrite)`` for a save, None for a promoter pass."""
FRESH = "step_9"


@dataclass(frozen=True)
class Run:
    """What a recorded run does: its ``steps``, the ``keep`` of the local and the shared tier,
    and whether a memory tier comes first (a power cut empties it; see :func:`floor_of`)."""

    steps: tuple[Step, ...]
    keep: tuple[int, int] = (2, 2)
    memory_first: bool = False


FIXED = Run(
    (("step_1", 1, False), ("step_2", 2, False), None, ("step_3", 3, False), ("step_2", 4, True), None)
)
"""The run ``make test`` cuts everywhere: two saves, a pass, a save, an overwrite, a pass."""


@dataclass
class Recorded:
    """A recorded run: its trace and the states saved, in order, by id."""

    run: Run
    trace: Trace
    saved: list[tuple[str, dict[str, Any]]]


def random_run(seed: int) -> Run:
    """A run of 3 to 6 steps drawn from ``seed``: new saves, overwrites of an earlier id and
    promoter passes, the first step a save, the last a pass; even seeds save to a memory tier
    first, odd ones to the local tier."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible draw, not a secret
    steps: list[Step] = [("step_1", 1, False)]
    ids = ["step_1"]
    for number in range(2, rng.randint(3, 6)):
        roll = rng.random()
        if roll < 0.3:
            steps.append(None)
        elif roll < 0.55:
            steps.append((rng.choice(ids), number, True))
        else:
            ids.append(f"step_{number}")
            steps.append((ids[-1], number, False))
    steps.append(None)
    return Run(tuple(steps), (rng.randint(1, 2), rng.randint(1, 3)), memory_first=seed % 2 == 0)


def _config(root: Path, run: Run) -> Config:
    """The tiers of ``run`` below ``root``; its memory tier (tmpfs: a power cut empties it) in
    ``<root>-memory``, outside what is recorded."""
    local, shared = run.keep
    memory = [{"name": "memory", "type": "memory", "path": f"{root}-memory/{{node}}", "keep": 2}]
    return config_from_dict(
        {
            "namespace": "run",
            "verify_on_load": True,
            "promote": {"workers": 1},  # one file at a time: the same trace every run
            "tiers": [
                *(memory if run.memory_first else []),
                {"name": "local", "type": "local", "path": f"{root}/local/{{node}}", "keep": local},
                {"name": "shared", "type": "shared", "path": f"{root}/shared", "keep": shared},
            ],
        }
    )


def _state(seed: int) -> dict[str, Any]:
    trainer = Trainer(seed)
    trainer.train(1)
    return trainer.state()


def _record(root: Path, run: Run) -> Recorded:
    config = _config(root, run)  # creates the tier directories: durable before the trace begins
    recorder = OsRecorder(root)
    saved: list[tuple[str, dict[str, Any]]] = []
    with recorder.active():
        for step in run.steps:
            if step is None:
                assert Promoter(config).run(once=True) == 0
                recorder.mark("promoted")
                continue
            checkpoint_id, seed, overwrite = step
            state = _state(seed)
            saved.append((checkpoint_id, copy.deepcopy(state)))
            writer = TieredWriter(config, overwrite=overwrite)
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
            recorder.mark(f"saved {len(saved) - 1}")
    return Recorded(run, recorder.trace, saved)


def floor_of(recorded: Recorded, after: int) -> int:
    """The index of the newest save a power cut after operation ``after`` must keep (-1: none).

    A save to a disk tier is durable once it returned. A save to a memory tier survives a power
    cut only once a promoter pass that began after it returned has finished (it copies every
    committed checkpoint down to the local disk)."""
    floor = -1
    pending = -1
    for label in recorded.trace.marks_before(after):
        if label.startswith("saved"):
            pending = int(label.split()[1])
            floor = floor if recorded.run.memory_first else pending
        else:
            floor = pending
    return floor


def _is_same(left: Any, right: Any) -> bool:
    try:
        assert_same(left, right)
    except AssertionError:
        return False
    return True


@functools.cache
def _target() -> dict[str, Any]:
    """The differently initialised state (:func:`fresh_target`'s) every load fills a copy of: built
    once, as a trainer and a training step per load took a third of a sweep's time."""
    return fresh_target()[1]


@functools.cache
def _fresh() -> dict[str, Any]:
    """The state a fresh save after a cut saves (a copy of it): built once."""
    return _state(9)


def _load(config: Config, checkpoint_id: str) -> dict[str, Any]:
    state = copy.deepcopy(_target())
    dcp.load(state, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)
    return state


def check_crash_state(recorded: Recorded, state: CrashState, where: Path, *, check_after: bool) -> None:
    """The oracle (see the module docstring) against ``state`` rebuilt in ``where``."""
    trace = recorded.trace
    op = trace.ops[state.after - 1] if state.after else None
    case = f"power cut after operation {state.after} ({op}), {state.variant}"
    materialise(state.tree, where)
    config = _config(where, recorded.run)
    floor = floor_of(recorded, state.after)
    latest = latest_committed(config, collective=False)
    if floor >= 0:
        assert latest is not None, f"{case}: nothing restorable, {recorded.saved[floor][0]} was"
    if latest is not None:
        loaded = _load(config, latest)
        matches = [i for i, (cid, s) in enumerate(recorded.saved) if cid == latest and _is_same(s, loaded)]
        assert matches, f"{case}: {latest} loads a state never saved under it"
        assert max(matches) >= floor, (
            f"{case}: {latest} is save {max(matches)}, older than save {floor}, which returned"
        )
    bad = [a for a in audit_all(config, [0]) if not a.ok]
    assert not bad, f"{case}: markers over bad data: {bad}"
    if check_after:
        fresh = _fresh()
        dcp.save(copy.deepcopy(fresh), storage_writer=TieredWriter(config), checkpoint_id=FRESH)
        assert Promoter(config).run(once=True) == 0, f"{case}: the promoter pass failed after"
        assert latest_committed(config, collective=False) == FRESH, case
        assert _is_same(fresh, _load(config, FRESH)), f"{case}: the fresh save loads other bytes"
        bad = [a for a in audit_all(config, [0]) if not a.ok]
        assert not bad, f"{case}: markers over bad data after a fresh save: {bad}"


def distinct_states(trace: Trace, *, prefixes: bool, flushed: bool) -> list[CrashState]:
    """The crash states after every operation (and before the first), each distinct pair of a
    tree and the saves returned before the cut once: the same tree after a later save returned
    must hold that save too, so it is checked again."""
    seen: set[tuple[str, int]] = set()
    states: list[CrashState] = []
    for after in range(len(trace.ops) + 1):
        candidates = trace.crash_states(after, flushed=flushed, prefixes=prefixes)
        returned = len(trace.marks_before(after))
        for state in candidates:
            key = (tree_digest(state.tree), returned)
            if key not in seen:
                seen.add(key)
                states.append(state)
    return states


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on tmpfs (the recorder's requirement), removed afterwards."""
    with tmpfs_dir("tierstore-power-") as directory:
        yield directory


def _cut_everywhere(root: Path, recorded: Recorded, *, variants: bool, after_every: int) -> tuple[int, int]:
    """Check every distinct crash state of ``recorded`` (``variants``: the flushed-directory and
    prefix-of-writes ones too), a fresh save and pass after every ``after_every``-th; return the
    counts of states and of states passed."""
    states = distinct_states(recorded.trace, prefixes=variants, flushed=variants)
    passed = 0
    for number, state in enumerate(states):
        where = root / f"crash-{number}"
        check_crash_state(recorded, state, where, check_after=number % after_every == 0)
        shutil.rmtree(where)
        shutil.rmtree(f"{where}-memory", ignore_errors=True)
        passed += 1
    return len(states), passed


@pytest.mark.slow
def test_every_power_cut_restores_the_last_returned_save(shm_dir: Path) -> None:
    """The fixed run, its conservative crash state after every operation; (c) on every fourth."""
    recorded = _record(shm_dir / "recorded", FIXED)
    states, passed = _cut_everywhere(shm_dir, recorded, variants=False, after_every=4)
    ops = len(recorded.trace.ops)
    print(f"power loss: {ops} operations, {states} crash states, {passed} passed")
    assert passed == states > 0


@pytest.mark.faults
@pytest.mark.timeout(900)  # the largest runs (6 steps, local first) take ~4 min on a busy machine
@pytest.mark.parametrize("seed", fault_seeds(1))
def test_power_cut_sweep(shm_dir: Path, seed: int) -> None:
    """A random run drawn from ``seed``, every crash state with its variants; (c) after each."""
    run = random_run(seed)
    print(f"power loss seed {seed}: {run}")
    recorded = _record(shm_dir / "recorded", run)
    states, passed = _cut_everywhere(shm_dir, recorded, variants=True, after_every=1)
    ops = len(recorded.trace.ops)
    print(f"power loss seed {seed}: {ops} operations, {states} crash states, {passed} passed")
    assert passed == states > 0
