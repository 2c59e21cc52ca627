"""Tier verdicts shared by the processes of one node: one rank finds a tier away, the others read it.

Eight ranks of a node restarting with S3 hung would each wait ``probe_timeout`` for it, and a rank
that starts later (a restore after the first save, the promoter beside them) would wait again. So
when a process's health view opens a tier's breaker, it leaves a verdict for its node in a small
file (:func:`verdicts_dir`: ``$TIERSTORE_HEALTH_DIR``, by default a directory of this user's in
``/dev/shm``), and the other processes of the node read it before they ask the tier: they skip it at
once, and probe it again only when the verdict is older than their probe period (a probe of any
process that fails writes the verdict anew, so the node re-probes about once a period, not once per
process). A probe that finds the tier back removes the verdict, and every process of the node that
skipped the tier asks it again.

A verdict is a hint with a lifetime (:data:`TRUSTED_FOR`): an older one (a job that died with its
tier away) is not read. Wall-clock times, which every process of one node shares. A directory that
cannot be used (read-only, another user's) leaves each process with its own view, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
DIR_ENV = "TIERSTORE_HEALTH_DIR"
TRUSTED_FOR = 60.0
"""Seconds a verdict is read after it was written (a probe that fails writes it anew)."""


@dataclass(frozen=True)
class Verdict:
    """One process's finding: the tier did not answer, why, when (wall clock) and who found it."""

    reason: str
    at: float
    pid: int

    @property
    def age(self) -> float:
        """Seconds since it was written (never negative)."""
        return max(0.0, time.time() - self.at)


def verdicts_dir() -> Path:
    """Where this node's verdicts live: ``$TIERSTORE_HEALTH_DIR``, else
    ``/dev/shm/tierstore-health-<uid>`` (the temp directory where there is no ``/dev/shm``)."""
    if named := os.environ.get(DIR_ENV):
        return Path(named)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"tierstore-health-{os.getuid()}"


def _path(key: str) -> Path:
    return verdicts_dir() / hashlib.sha256(key.encode()).hexdigest()[:24]


def read(key: str) -> Verdict | None:
    """The node's verdict on the tier of health key ``key``; None when there is none younger than
    :data:`TRUSTED_FOR` (or it cannot be read)."""
    try:
        found = json.loads(_path(key).read_text())
        verdict = Verdict(str(found["reason"]), float(found["at"]), int(found["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return verdict if verdict.age < TRUSTED_FOR else None


def write(key: str, reason: str) -> bool:
    """Leave this process's verdict for the node (atomically); False when the directory cannot be
    used (this process's view stands alone then)."""
    path = _path(key)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.parent.stat().st_uid != os.getuid():  # another user's: not to be trusted
            return False
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as temp:
            json.dump({"reason": reason, "at": time.time(), "pid": os.getpid()}, temp)
        os.replace(temp.name, path)
    except OSError as exc:
        logger.debug("tier verdicts cannot be shared in %s: %s", path.parent, exc)
        return False
    return True


def clear(key: str) -> None:
    """The tier answers again: remove the node's verdict."""
    with contextlib.suppress(OSError):
        _path(key).unlink()


def present(key: str) -> bool:
    """Whether a verdict (of any age) stands for the tier of ``key``."""
    return _path(key).exists()
