"""Named kill points: a test hook that ends this process with ``SIGKILL`` at one chosen step.

The writer, the marker publish, the promotion and the cleanup call :func:`kill_point` at the steps
where a crash matters (every name is in :data:`KILL_POINTS`). A test arms one of them for a process it
starts by setting ``TIERSTORE_KILL_POINT`` in that process's environment::

    TIERSTORE_KILL_POINT=name[@subject][:n]

The process then kills itself with ``SIGKILL`` the ``n``-th time (default 1) it reaches ``name``
(with ``@subject``: only reaches whose subject, e.g. the path being published, contains it), after
writing ``tierstore: kill point <name> reached`` to stderr. Nothing is flushed or cleaned up: it is
a crash. ``TIERSTORE_KILL_SIGNAL=SIGSTOP`` sends that signal instead: the process stops there, as a
paused one would (a long pause, a frozen VM), until the test sends ``SIGCONT``. The variables are
read once, when this module is imported; unset (always, outside the tests),
a call is one comparison with ``None``. This is not configuration: nothing but the fault tests
(``tests/guarantees/test_kill_points.py``) sets it.
"""

from __future__ import annotations

import itertools
import os
import signal

VARIABLE = "TIERSTORE_KILL_POINT"
"""The environment variable that arms a kill point (read once, at import)."""
SIGNAL_VARIABLE = "TIERSTORE_KILL_SIGNAL"
"""The signal the armed point sends this process (a name: ``SIGSTOP``); ``SIGKILL`` unless set."""

KILL_POINTS: dict[str, str] = {
    "writer.planned": "a rank's write_data begins: staged, number claimed, no data file yet",
    "writer.mid_file": "a rank's data file half written (its hidden temp file holds one tensor)",
    "writer.data_written": "a rank's data files durable, before the coordinator's finish",
    "writer.metadata_written": "the coordinator's .metadata durable, before the marker",
    "writer.committed": "the marker published, before the write record ends and the mirror hears",
    "marker.files_checked": "protocol.publish: every named file checked, before the marker",
    "marker.published": "protocol.publish: the marker stands, before the files are checked again",
    "marker.rechecked": "protocol.publish: checked again, before the log entry and the replaced drop",
    "posix.publish.temp_synced": "POSIX publish: the temp file fsynced, before link or rename",
    "posix.publish.linked": "POSIX create-only publish: linked, before the temp name is removed",
    "promote.mid_copy": "a promotion wrote a chunk into the target (S3: a part of a multipart upload)",
    "promote.data_copied": "a promotion's files are in the target, before its marker or part",
    "promote.committed": "a promotion committed, before the promoter's metrics and sightings",
    "drop.marker_withdrawn": "a drop removed the marker, before log entries, parts and data",
    "drop.records_dropped": "a drop removed log entries and part records, before the data",
    "protocol.effect": "the protocol's executor, before any effect (subject: <Effect>/<id>)",
    "retention.decided": "retention decided its deletions, before the first (subject: tier/id ...)",
    "retention.between_deletes": "retention deleted one copy, before the next",
    "cleanup.between_removals": "cleanup removed one leftover, before the next",
}
"""Every kill point, with the moment it stands for. A test checks that each is called in the
package exactly where its name says, and that no call names a point missing here."""


class _Armed:
    """The kill point the environment names: which reach of it, with which subject, kills."""

    def __init__(self, spec: str) -> None:
        rest, _, nth = spec.partition(":")
        self.name, _, self.subject = rest.partition("@")
        if self.name not in KILL_POINTS or not (nth or "1").isdigit():
            raise ValueError(
                f"{VARIABLE}={spec!r}: expected name[@subject][:n] with a count n and one of"
                f" {', '.join(sorted(KILL_POINTS))}"
            )
        self.nth = int(nth or 1)
        self.signal = signal.Signals[os.environ.get(SIGNAL_VARIABLE) or "SIGKILL"]
        self._reaches = itertools.count(1)  # next() is atomic under the GIL: threads count once

    def reached(self, name: str, subject: str) -> None:
        if name != self.name or self.subject not in subject:
            return
        if next(self._reaches) == self.nth:
            os.write(2, f"tierstore: kill point {name} reached ({subject or '-'})\n".encode())
            os.kill(os.getpid(), self.signal)


_ARMED = _Armed(os.environ[VARIABLE]) if os.environ.get(VARIABLE) else None


def kill_point(name: str, subject: str = "") -> None:
    """Die here with ``SIGKILL`` if the test hook armed ``name`` (see the module docstring).

    ``subject`` says what the step works on (a path), for the ``@subject`` filter. Returns at once
    when ``TIERSTORE_KILL_POINT`` was unset at import.
    """
    if _ARMED is not None:
        _ARMED.reached(name, subject)


__all__ = ["KILL_POINTS", "SIGNAL_VARIABLE", "VARIABLE", "kill_point"]
