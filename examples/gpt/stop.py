"""Pre-emption notices (SIGTERM, SIGUSR1), noted from the moment this module is imported.

``train_gpt.py`` imports it before torch: a notice that arrives while the job starts (right after a
requeue) must become a clean stop at the next agreed step, not a death by the signal's default action.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
received: list[str] = []
"""Names of the stop signals this process received, in order."""


def _note(signum: int, _frame: object) -> None:
    received.append(signal.Signals(signum).name)


for _signum in STOP_SIGNALS:
    signal.signal(_signum, _note)
