"""A model of the keeper lease: three promoters of three machines watch, take, renew and fence one
job-wide tier while time passes, and any of them may be paused, resumed, or killed and restarted.

Each promoter is a :class:`~tierstore.promote.keeper.Keeper` on the tests' ``dict`` tier, with a
clock of its own (the machines' clocks are offset from one another; they run at one rate). An
*act* is what a keeper does to its tier: it acts when its fence says yes, at once (the model makes
the fence and the one effect it guards one step: the window between them is the documented one).
A paused promoter does nothing while its clock runs on; a killed one never acts again, and a new
process of the same machine replaces it.

After every step:

* **no two keepers act in one epoch**;
* **no act of an epoch after an act of a later one**: a former keeper, however long it was paused,
  acts no more once another took over and acted;
and once every promoter has run unpaused for three lease durations of ticks, **exactly one keeps
the tier**.
"""

from __future__ import annotations

import os
import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tests.tiers.dict_tier  # noqa: F401 - registers the dict tier type
from tierstore.config import config_from_dict
from tierstore.promote.keeper import RENEWALS, Keeper
from tierstore.records.lease import Holder
from tierstore.tiers import make_tier

DURATION = 30.0
MACHINES = (0, 1, 2)
EXAMPLES = int(os.environ.get("TIERSTORE_MODEL_EXAMPLES", "100"))


class KeeperLease(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize()
    def set_up(self) -> None:
        config = config_from_dict({"tiers": [{"name": "wide", "type": "dict", "store": uuid.uuid4().hex}]})
        self.tier = make_tier(config.tiers[0], namespace=None, node=0)
        self.time = 0.0
        self.offsets = {m: 1000.0 * m for m in MACHINES}
        self.next_pid = 100
        self.live_pids: set[int] = set()
        self.keepers = {m: self._process(m) for m in MACHINES}
        self.paused: set[int] = set()
        self.acts: list[tuple[int, str]] = []
        """``(epoch, keeper token)`` of every act, in the order they happened."""

    def _process(self, machine: int) -> Keeper:
        """A new promoter process on ``machine``."""
        self.next_pid += 1
        self.live_pids.add(self.next_pid)
        me = Holder(machine, f"host-{machine}", "ns", self.next_pid, uuid.uuid4().hex, 0.0)
        return Keeper(
            self.tier,
            me,
            DURATION,
            clock=lambda machine=machine: self.time + self.offsets[machine],
            alive=lambda pid: pid in self.live_pids,
        )

    @rule(
        seconds=st.sampled_from([1.0, DURATION / RENEWALS / 2, DURATION / RENEWALS, DURATION / 2, DURATION])
    )
    def time_passes(self, seconds: float) -> None:
        self.time += seconds

    @rule(machine=st.sampled_from(MACHINES), then_act=st.booleans())
    def tick(self, machine: int, then_act: bool) -> None:
        """Its thread renews or watches; then, maybe, the pass acts."""
        if machine not in self.paused:
            self.keepers[machine].tick()
            if then_act:
                self.act(machine)

    @rule(machine=st.sampled_from(MACHINES))
    def act(self, machine: int) -> None:
        keeper = self.keepers[machine]
        if machine not in self.paused and keeper.fence():
            assert keeper.epoch is not None
            self.acts.append((keeper.epoch, keeper.me.token))

    @rule(machine=st.sampled_from(MACHINES))
    def pause(self, machine: int) -> None:
        self.paused.add(machine)

    @rule(machine=st.sampled_from(MACHINES))
    def resume(self, machine: int) -> None:
        self.paused.discard(machine)

    @rule(machine=st.sampled_from(MACHINES))
    def kill_and_restart(self, machine: int) -> None:
        self.live_pids.discard(self.keepers[machine].me.pid)
        self.paused.discard(machine)
        self.keepers[machine] = self._process(machine)

    @rule()
    def all_run_three_leases(self) -> None:
        """Every promoter resumes and ticks, as its thread would, for three lease durations: then
        exactly one keeps the tier (a live keeper is found)."""
        self.paused.clear()
        for _ in range(3 * RENEWALS + 1):
            self.time += DURATION / RENEWALS
            for machine in MACHINES:
                self.keepers[machine].tick()
        assert sum(k.keeps() for k in self.keepers.values()) == 1

    @invariant()
    def no_two_keepers_act_in_one_epoch(self) -> None:
        actors: dict[int, set[str]] = {}
        for epoch, token in self.acts:
            actors.setdefault(epoch, set()).add(token)
        assert all(len(tokens) == 1 for tokens in actors.values()), actors

    @invariant()
    def no_act_of_an_epoch_after_a_later_one(self) -> None:
        epochs = [epoch for epoch, _token in self.acts]
        assert epochs == sorted(epochs), epochs


TestKeeperLease = KeeperLease.TestCase
TestKeeperLease.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
