"""The commit state machine under concurrent actors (tests/records/machine_model.py), and the
mutation kit (tests/records/mutants.py): every mutant must break an invariant of the model.

``TIERSTORE_MODEL_EXAMPLES`` sets the number of schedules (``make soak`` runs many)."""

from __future__ import annotations

import os

import pytest

from tests.records.machine_model import Violation, explore, mutated
from tests.records.mutants import MUTANTS, Mutant
from tierstore.records import machine

EXAMPLES = int(os.environ.get("TIERSTORE_MODEL_EXAMPLES", "100"))


def test_the_machine_keeps_every_invariant_under_interleaved_effects() -> None:
    explore(machine, examples=EXAMPLES * 4, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_model_kills_the_mutant(mutant: Mutant) -> None:
    with pytest.raises(Violation):
        explore(mutated(machine, mutant.old, mutant.new), examples=max(600, EXAMPLES * 4), seed=2)


def test_the_kit_holds_at_least_ten_ordering_bugs() -> None:
    assert len({m.name for m in MUTANTS}) >= 10
