"""Pre-emption notices (SIGTERM, SIGUSR1), noted from the moment this module is imported.

``train_gpt.py`` imports it before torch: a notice that arrives while the job starts (right after a
requeue) must become a clean stop at the next agreed step, not a death by the signal's default action.

Only in the trainer itself: DCP's checkpoint process (PROCESS mode) re-imports the main module when it
is spawned, and must keep SIGTERM's default action, which is how multiprocessing stops it at exit. A
stop signal sent to the whole process group therefore ends it, and a periodic save it was writing
fails (and is logged); the final save is synchronous and does not depend on it.
"""

from __future__ import annotations

import multiprocessing
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
received: list[str] = []
"""Names of the stop signals this process received, in order."""


def _note(signum: int, _frame: object) -> None:
    received.append(signal.Signals(signum).name)


# Not parent_process(): a spawned child imports the main module before that is set; its name is set
# first.
if multiprocessing.current_process().name == "MainProcess":  # the trainer, not a process it spawned
    for _signum in STOP_SIGNALS:
        signal.signal(_signum, _note)
