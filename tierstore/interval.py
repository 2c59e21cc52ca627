"""Choosing the save interval: Young's rule with Daly's correction, from measured costs.

With C the stall a save costs the trainer, M the job's mean time between failures, R the time to
restart and restore, and U the durability lag (how long a save stays only in fast, fragile tiers):

* Young: ``T = sqrt(2·C·M)``;
* Daly (2006): ``T = sqrt(2·C·M)·[1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] - C`` when ``C < 2M``, else ``M``;
* expected waste, as a fraction of run time, to first order: ``C/T`` (saving) + ``(T/2 + U)/M``
  (rework after a failure: half an interval on average, plus the lag) + ``R/M`` (restarting).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Advice:
    """The recommended interval and what it costs."""

    stall_s: float
    mtbf_s: float
    restart_s: float
    durable_lag_s: float
    young_s: float
    daly_s: float
    waste_saving: float
    waste_rework: float
    waste_restart: float

    @property
    def waste(self) -> float:
        """Total expected fraction of time lost at Daly's interval."""
        return self.waste_saving + self.waste_rework + self.waste_restart

    def as_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {**asdict(self), "waste": self.waste}


def young(stall: float, mtbf: float) -> float:
    """Young's first-order optimum interval."""
    return math.sqrt(2 * stall * mtbf)


def daly(stall: float, mtbf: float) -> float:
    """Daly's higher-order optimum interval (falls back to ``mtbf`` when saves are very costly)."""
    if stall >= 2 * mtbf:
        return mtbf
    ratio = stall / (2 * mtbf)
    return young(stall, mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - stall


def advise(stall: float, mtbf: float, restart: float = 0.0, durable_lag: float = 0.0) -> Advice:
    """The interval to save at, and the expected waste there (see the module docstring)."""
    if stall <= 0 or mtbf <= 0 or restart < 0 or durable_lag < 0:
        raise ValueError("need stall > 0, mtbf > 0, restart >= 0 and durable lag >= 0")
    interval = max(daly(stall, mtbf), 1e-9)
    return Advice(
        stall_s=stall,
        mtbf_s=mtbf,
        restart_s=restart,
        durable_lag_s=durable_lag,
        young_s=young(stall, mtbf),
        daly_s=interval,
        waste_saving=stall / interval,
        waste_rework=(interval / 2 + durable_lag) / mtbf,
        waste_restart=restart / mtbf,
    )
