"""A model of the commit protocol: actors interleave at random, the invariants are checked after every step.

Actors (hypothesis's ``RuleBasedStateMachine``): a saver into the fast tier and one straight into the
durable tier (``tier=``), with and without ``overwrite``, on a small pool of ids so overwrites and
refusals happen; the promoter (promotion, retention, and gc with ``stale_after: 0``); a crash of a
saver or of the promoter after any number of store operations (it does nothing more: a kill); an
outage of the durable tier that starts and ends; host memory lost (a power cut or a replaced node:
the fast tier comes back empty and both actors restart). The tiers are the tests' ``dict`` tier type, whose
fault hooks (``tests/tiers/dict_tier.py``) are the only thing injected: nothing in tierstore is patched.

After every step, over the tiers that are up:

* **no marker over missing or wrong data** (every named file present, its size and CRC32C right);
* **every committed id restores to exactly the contents of its newest commit** (the generation with
  the highest commit number among its markers), never an older generation's;
* **latest_committed** is the id whose newest commit is the newest of all;
* **nothing committed and kept is lost**: the last save that returned successfully is still committed
  somewhere (retention never deletes a tier's newest copy, nor the newest one not yet durable).

A failing example shrinks to a short sequence and prints its seed. ``make soak`` runs many more
examples (``TIERSTORE_MODEL_EXAMPLES``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.tiers.dict_tier import FAULTS
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.cli.audit import audit_copy
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records import known
from tierstore.records.activity import HEARTBEAT, held
from tierstore.records.catalog import marker_times
from tierstore.records.marker import Manifest, read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier

IDS = ("x", "y", "z")
EXAMPLES = int(os.environ.get("TIERSTORE_MODEL_EXAMPLES", "12"))


def _state(value: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(value)), "value": value}


class CommitProtocol(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize()
    def set_up(self) -> None:
        run = uuid.uuid4().hex[:8]
        self.config: Config = config_from_dict(
            {
                "tiers": [
                    {"name": "fast", "type": "dict", "store": f"fast-{run}", "keep": 2},
                    {"name": "mid", "type": "dict", "store": f"mid-{run}", "keep": 2},
                    {"name": "durable", "type": "dict", "store": f"durable-{run}", "keep": 3},
                ],
                "probe_timeout": "5s",
                "promote": {"stale_after": 0, "activity_ttl": "1s"},
            }
        )
        self.durable_store = f"durable-{run}"
        self.tiers: dict[str, Tier] = {t.name: t for t in self.config.make_tiers(node=0)}
        self.promoter = Promoter(self.config)
        """One promoter process for as long as it lives: its listings of each tier are reused
        across passes while the tier's change stamp holds (promote/views.py); a kill or a lost
        host starts a new one."""
        self.values: dict[tuple[str, str], int] = {}
        """``(id, generation)`` -> the value saved in it (committed, or committed in doubt)."""
        self.counter = 0
        self.last_success: str | None = None
        self.unsighted: set[str] = set()
        """Ids this trainer process saved with ``tier=`` since the promoter last sighted the tiers."""
        self.window: set[str] = set()
        """Such ids of a trainer process that has since died: until the promoter's next pass, other
        processes may not see them (the documented window, docs/operations.md)."""

    # -- actors -----------------------------------------------------------------------------------

    def _save(self, checkpoint_id: str, tier: str, overwrite: bool) -> bool:
        self.counter += 1
        value = self.counter
        writer = TieredWriter(self.config, tier=tier, overwrite=overwrite)
        try:
            dcp.save(_state(value), storage_writer=writer, checkpoint_id=checkpoint_id)
            ok = True
        except BaseException:  # noqa: BLE001 - refusals, outages and crashes are all outcomes here
            ok = False
        finally:
            crashed = FAULTS.revive()
        if tier != "fast":
            self.unsighted.add(checkpoint_id)
        if crashed:
            self._bury_the_dead(trainer=True)
        self._learn(checkpoint_id, value)
        if ok:
            self.last_success = checkpoint_id
        return ok

    def _learn(self, checkpoint_id: str, value: int) -> None:
        """Any generation of the id a marker names that the model has not seen is this save's."""
        for tier in self._up():
            try:
                generation = read_manifest(tier, checkpoint_id, trust=MarkerTrust()).generation
            except FileNotFoundError:
                continue
            self.values.setdefault((checkpoint_id, generation), value)

    def _bury_the_dead(self, *, trainer: bool) -> None:
        """A killed actor refreshes nothing any more: its records age out as a dead process's do.
        A killed trainer's next save comes from a new process, which knows only what it reads at
        start-up: its ``tier=`` commits not yet sighted by the promoter enter the documented window
        (other processes see them after the promoter's next pass)."""
        for activity in HEARTBEAT.get().holding():
            activity.released = True
            HEARTBEAT.get().forget(activity)
        if trainer:
            known._KNOWN.get().clear()
            self.window |= self.unsighted
            self.unsighted = set()

    def _up(self) -> list[Tier]:
        return [t for t in self.tiers.values() if t.store not in FAULTS.down]  # type: ignore[attr-defined]

    @rule(checkpoint_id=st.sampled_from(IDS), overwrite=st.booleans())
    def save_fast(self, checkpoint_id: str, overwrite: bool) -> None:
        self._save(checkpoint_id, "fast", overwrite)

    @rule(checkpoint_id=st.sampled_from(IDS), overwrite=st.booleans())
    def save_durable(self, checkpoint_id: str, overwrite: bool) -> None:
        self._save(checkpoint_id, "durable", overwrite)

    @rule(checkpoint_id=st.sampled_from(IDS), verbs=st.integers(0, 40), overwrite=st.booleans())
    def save_killed(self, checkpoint_id: str, verbs: int, overwrite: bool) -> None:
        FAULTS.arm(verbs)
        self._save(checkpoint_id, "fast", overwrite)

    @rule()
    def promoter_pass(self) -> None:
        try:
            self.promoter.run_once()
        finally:
            FAULTS.revive()
        if self.durable_store not in FAULTS.down:  # a full pass sighted every tier
            self.unsighted, self.window = set(), set()

    @rule(verbs=st.integers(0, 60))
    def promoter_killed(self, verbs: int) -> None:
        FAULTS.arm(verbs)
        try:
            self.promoter.run_once()
        except BaseException:  # noqa: BLE001, S110 - the kill itself
            pass
        finally:
            if FAULTS.revive():
                self._bury_the_dead(trainer=False)
                self.promoter = Promoter(self.config)  # restarted: a new process

    @rule()
    def host_memory_lost(self) -> None:
        """A power cut or a replaced node: the fast tier (host memory) comes back empty, and the
        trainer and the promoter restart in new processes. A save committed only there is gone
        (it was not durable yet: docs/operations.md)."""
        self.tiers["fast"].objects.clear()  # type: ignore[attr-defined]
        self._bury_the_dead(trainer=True)
        self.promoter = Promoter(self.config)
        if self.last_success not in self._markers(up_only=False):
            self.last_success = None

    @precondition(lambda self: self.durable_store not in FAULTS.down)
    @rule()
    def durable_tier_goes_away(self) -> None:
        FAULTS.down.add(self.durable_store)

    @precondition(lambda self: self.durable_store in FAULTS.down)
    @rule()
    def durable_tier_comes_back(self) -> None:
        FAULTS.down.discard(self.durable_store)

    def teardown(self) -> None:
        FAULTS.down.discard(getattr(self, "durable_store", ""))
        FAULTS.revive()

    # -- invariants -------------------------------------------------------------------------------

    def _markers(self, *, up_only: bool) -> dict[str, list[tuple[int, str, str]]]:
        """``{id: [(seq, generation, tier)]}`` of the markers in the tiers (all of them, or only
        those up), read behind the tiers' back: the oracle is not subject to the outage."""
        found: dict[str, list[tuple[int, str, str]]] = {}
        for name, tier in self.tiers.items():
            store = tier.store  # type: ignore[attr-defined]
            if up_only and store in FAULTS.down:
                continue
            for checkpoint_id in IDS:
                blob = tier.objects.get(f"{checkpoint_id}/commit.json")  # type: ignore[attr-defined]
                if blob is None:
                    continue
                manifest = Manifest.from_json(blob[0], where=f"{name}/{checkpoint_id}")
                found.setdefault(checkpoint_id, []).append((manifest.seq or 0, manifest.generation, name))
        return found

    def _restorable(self) -> dict[str, tuple[int, str]]:
        """``{id: (seq, generation)}`` of each id whose newest commit anywhere is held by a tier
        that is up: what a restore must serve. An id whose newest commit is only in a tier that is
        away is not restorable (serving an older generation would undo that commit)."""
        everywhere, up = self._markers(up_only=False), self._markers(up_only=True)
        found: dict[str, tuple[int, str]] = {}
        for checkpoint_id, commits in everywhere.items():
            seq, generation, _tier = max(commits)
            if any(g == generation for _s, g, _t in up.get(checkpoint_id, [])):
                found[checkpoint_id] = (seq, generation)
        return found

    @invariant()
    def no_marker_over_missing_or_wrong_data(self) -> None:
        if not hasattr(self, "config"):
            return
        audits = [
            audit_copy({0: tier}, checkpoint_id, 0, trust=MarkerTrust())
            for tier in self._up()
            for checkpoint_id in marker_times(tier)
        ]
        bad = [a for a in audits if not a.ok]
        assert bad == [], bad

    @invariant()
    def every_committed_id_restores_its_newest_commit(self) -> None:
        if not hasattr(self, "config"):
            return
        restorable = self._restorable()
        for checkpoint_id in self._markers(up_only=True):
            target = _state(-1)
            try:
                dcp.load(target, storage_reader=TieredReader(self.config), checkpoint_id=checkpoint_id)
            except BaseException:  # noqa: BLE001 - judged below
                assert checkpoint_id not in restorable, f"{checkpoint_id} did not restore"
                continue
            served = int(target["value"])
            if checkpoint_id in self.window:  # any of its committed contents, newest not assured
                assert served in {v for (i, _g), v in self.values.items() if i == checkpoint_id}
                continue
            assert checkpoint_id in restorable, f"{checkpoint_id}: served an older generation"
            expected = self.values.get((checkpoint_id, restorable[checkpoint_id][1]))
            assert served == expected, (checkpoint_id, restorable[checkpoint_id])
            assert torch.equal(target["w"], _state(int(target["value"]))["w"])

    @invariant()
    def latest_is_the_newest_commit(self) -> None:
        if not hasattr(self, "config"):
            return
        newest = self._restorable()
        expected = max(newest, key=lambda i: newest[i], default=None)
        latest = latest_committed(self.config, collective=False)
        if expected in self.window:  # a newer id the window may hide: an older one is allowed
            outside = {i: o for i, o in newest.items() if i not in self.window}
            allowed = {expected, max(outside, key=lambda i: outside[i], default=None)}
            assert latest in allowed | self.window, (latest, expected)
            return
        if latest is not None and latest != expected and latest in self.window:
            # A new process may not know of the id's newer commit in a tier that is away (the
            # window): it names the id by the newest commit it can see, which must still be newer
            # than every restorable id outside the window.
            seen = max(seq for seq, _g, _t in self._markers(up_only=True)[latest])
            outside = [o[0] for i, o in newest.items() if i not in self.window]
            assert all(seq < seen for seq in outside), (latest, seen, newest)
            return
        assert latest == expected

    @invariant()
    def the_last_successful_save_is_not_lost(self) -> None:
        if not hasattr(self, "config") or self.last_success is None:
            return
        if FAULTS.down:  # it may be committed only in the tier that is away
            return
        assert self.last_success in self._markers(up_only=True), self.last_success


TestCommitProtocol = CommitProtocol.TestCase
TestCommitProtocol.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)


def test_a_new_process_names_an_id_in_the_window_by_the_commit_it_can_see() -> None:
    """Found by the model: x saved fast, then overwritten straight into the durable tier, which goes
    away; a killed trainer's successor cannot know of that newer commit (the documented window)
    and names x by its older commit in the fast tier. Allowed; the invariant once wanted None."""
    state = CommitProtocol()
    state.set_up()
    try:
        state.save_fast(checkpoint_id="x", overwrite=False)
        state.save_durable(checkpoint_id="x", overwrite=True)
        state.durable_tier_goes_away()
        state.save_killed(checkpoint_id="x", overwrite=False, verbs=0)
        assert latest_committed(state.config, collective=False) == "x" and "x" in state.window
        state.latest_is_the_newest_commit()
        state.every_committed_id_restores_its_newest_commit()
    finally:
        state.teardown()


def _replay_then_check(*steps: tuple[str, dict[str, Any]]) -> None:
    """Run the model's rules ``steps`` in order, then check the restore and latest invariants."""
    state = CommitProtocol()
    state.set_up()
    try:
        for rule_name, arguments in steps:
            getattr(state, rule_name)(**arguments)
        state.every_committed_id_restores_its_newest_commit()
        state.latest_is_the_newest_commit()
    finally:
        state.teardown()


_X = {"checkpoint_id": "x"}


def test_host_memory_lost_while_the_durable_tier_is_away_serves_no_overwritten_content() -> None:
    """Found by the model: x saved fast, overwritten straight into the durable tier; a promoter pass
    copied the fast (older) content into the middle tier; the durable tier went away and host
    memory was lost (with the sightings that knew better). A restore then served the older
    content from the middle tier. The promoter no longer copies a content a newer commit overtook."""
    _replay_then_check(
        ("save_fast", {**_X, "overwrite": False}),
        ("save_durable", {**_X, "overwrite": True}),
        ("promoter_pass", {}),
        ("durable_tier_goes_away", {}),
        ("host_memory_lost", {}),
    )


def test_host_memory_lost_after_an_overwrite_into_the_durable_tier_serves_nothing_older() -> None:
    """Found by the model: x promoted into the middle tier, then overwritten straight into the
    durable tier; after a promoter pass, the durable tier went away and host memory was lost. The
    middle tier still held the older content, and a restore served it. The promoter now drops a
    copy that an overwrite in a slower tier replaced (policy.overtaken)."""
    _replay_then_check(
        ("save_fast", {**_X, "overwrite": False}),
        ("promoter_pass", {}),
        ("save_durable", {**_X, "overwrite": True}),
        ("promoter_pass", {}),
        ("durable_tier_goes_away", {}),
        ("host_memory_lost", {}),
    )


def test_a_copy_kept_in_use_is_not_served_over_a_newer_commit_its_tier_has_sighted() -> None:
    """Found by the model (a killed promoter's record kept x in use, so retention kept the older
    copy): x in the middle tier, overwritten straight into the durable tier, the promoter's pass
    keeps the middle tier's copy (a restore is reading it) and leaves its sightings there; then
    the durable tier goes away and host memory is lost with the fast tier's sightings. A new
    process must not serve the middle tier's older content: the sightings there say better."""
    state = CommitProtocol()
    state.set_up()
    try:
        state.save_fast(checkpoint_id="x", overwrite=False)
        state.promoter_pass()
        state.save_durable(checkpoint_id="x", overwrite=True)
        mid = state.tiers["mid"]
        with held(mid, "read", "x", read_manifest(mid, "x", trust=MarkerTrust()).generation):
            state.promoter_pass()
        assert read_manifest(mid, "x", trust=MarkerTrust()).seq == 1, "the older copy was in use: kept"
        state.durable_tier_goes_away()
        state.host_memory_lost()
        state.every_committed_id_restores_its_newest_commit()
        state.latest_is_the_newest_commit()
    finally:
        state.teardown()
