"""Seeds of the randomised fault sweeps (marker ``faults``).

``make test`` runs each sweep on its first few fixed seeds, the deterministic subset; ``make faults``
sets ``TIERSTORE_FAULT_SEEDS`` and runs the long sweep. Every case prints its seed, so a failure is
reproduced by running that one seed (``TIERSTORE_FAULT_SEED=<seed>``).
"""

from __future__ import annotations

import os

SEEDS_VARIABLE = "TIERSTORE_FAULT_SEEDS"
"""How many seeds each sweep runs (``make faults`` sets it; unset: the sweep's own small default)."""
ONE_SEED_VARIABLE = "TIERSTORE_FAULT_SEED"
"""Run only this seed (to reproduce a printed failure)."""


def fault_seeds(default: int) -> list[int]:
    """The seeds a sweep runs: ``0 .. n-1``, where n is ``TIERSTORE_FAULT_SEEDS`` or ``default``;
    only ``TIERSTORE_FAULT_SEED`` when that is set."""
    one = os.environ.get(ONE_SEED_VARIABLE)
    if one:
        return [int(one)]
    count = int(os.environ.get(SEEDS_VARIABLE) or default)
    if count < 1:
        raise ValueError(f"{SEEDS_VARIABLE}={count}: expected a positive number of seeds")
    return list(range(count))
