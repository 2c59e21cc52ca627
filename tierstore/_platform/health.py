"""This process's view of its tiers' health: one circuit breaker per tier, for every operation.

A tier found unreachable — a question to it unanswered within ``probe_timeout`` (it accepts
connections and never answers, a hung mount), or an outage its client reports (connection refused,
5xx past its retries: :class:`~tierstore.errors.TierUnavailableError` with ``outage`` set) — is
*open*: every later question of this process to it is answered at once with
:class:`~tierstore.errors.TierUnavailableError`, whichever operation asks (``latest_committed``, a
restore's tier choice and reads, a save's start-up look, ``ls``, ``status``, the promoter). So a
restart pays a sick tier's deadline once, not once per operation, and the process says so in one
log line, not one per operation.

The way back is a background probe: a question to an open tier, once ``probe_timeout`` (at least
:data:`RETRY_AFTER`) has passed since its last probe, starts one on a daemon thread (a cheap read:
``tier.exists("")``, never a write) and waits for its answer, within ``probe_timeout``: when the
probe answers, the tier is closed again and that question reaches it (a restore long after a blip
is served); other questions are answered at once. Probes run only when someone asks: a process
that asks nothing of a sick tier (a save into host memory) sends it nothing, and never more than
one probe is in flight per tier, so a hung tier never accumulates threads (nor makes a later
question wait: its probe stays in flight).

Tiers are told apart by :attr:`Probed.health_key` (type, root and endpoint), not by name: two
configurations in one process may call different stores ``s3``. A forked child starts with a
fresh view (:class:`~tierstore._platform.runtime.ProcessLocal`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

from tierstore._platform.runtime import ProcessLocal
from tierstore.errors import TierUnavailableError, one_line

logger = logging.getLogger(__name__)
RETRY_AFTER = 1.0
"""Fewest seconds between two probes of one open tier."""


class Probed(Protocol):
    """What the view needs of a tier (``tierstore.tiers.Tier`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def health_key(self) -> str: ...

    def exists(self, path: str) -> bool: ...


@dataclass
class _Open:
    """An unreachable tier: why, since when, and its probe."""

    reason: str
    since: float
    probed_at: float
    probe: Future[object] | None = field(default=None)


class TierHealth:
    """The circuit breakers of this process's tiers (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}

    def check(self, tier: Probed, timeout: float) -> None:
        """Return if ``tier`` may be asked; else raise :class:`TierUnavailableError` at once, or,
        when a probe is due, once the probe it starts has not answered within ``timeout``."""
        key = tier.health_key
        with self._lock:
            state = self._open.get(key)
            if state is None:
                return
            if state.probe is not None and state.probe.done():
                if state.probe.exception() is None:
                    del self._open[key]
                    logger.info("tier %s answers again: this process asks it again", tier.name)
                    return
                state.probe = None
            now = time.monotonic()
            started = None
            if state.probe is None and now - state.probed_at >= max(timeout, RETRY_AFTER):
                state.probed_at = now
                state.probe = started = _probe(tier)
            away = now - state.since
        if started is not None:
            # The question that starts a probe waits for its answer (within the deadline): a tier
            # back since must serve it, or a process asking rarely (a restore after a blip) would
            # fail each time. A hung tier's probe stays in flight: no later question waits.
            wait([started], timeout=timeout)
            if started.done() and started.exception() is None:
                with self._lock:
                    closed = self._open.get(key) is state
                    if closed:  # else another question closed it meanwhile (or it failed again)
                        del self._open[key]
                if closed:
                    logger.info("tier %s answers again: this process asks it again", tier.name)
                return
        raise TierUnavailableError(
            f"tier {tier.name}: skipped, unreachable for {away:.0f}s ({state.reason}); this process"
            " asks it again once a background probe finds it back",
            tier=tier.name,
            outage=True,
        )

    def failed(self, tier: Probed, error: BaseException) -> None:
        """``tier`` did not answer (``error``): open its breaker; the first time, say so (one
        WARNING line for the whole process)."""
        reason = one_line(str(error))
        with self._lock:
            if tier.health_key in self._open:
                return
            now = time.monotonic()
            self._open[tier.health_key] = _Open(reason, now, now)
        logger.warning(
            "tier %s is unreachable (%s): this process skips it until a background probe finds it back",
            tier.name,
            reason,
        )

    def is_open(self, tier: Probed) -> bool:
        """True while ``tier`` is skipped."""
        with self._lock:
            return tier.health_key in self._open

    def _forget(self) -> None:
        """Tests only: forget every verdict (a new process's view)."""
        with self._lock:
            self._open.clear()


def _probe(tier: Probed) -> Future[object]:
    """Ask ``tier`` a cheap read on a daemon thread; the future holds whether it answered."""
    future: Future[object] = Future()

    def run() -> None:
        try:
            future.set_result(tier.exists(""))
        except (FileNotFoundError, PermissionError) as exc:
            future.set_result(exc)  # an answer, though not a yes: the tier is reachable
        except BaseException as exc:  # noqa: BLE001 - still unreachable: told by the future
            future.set_exception(exc)

    threading.Thread(target=run, name=f"tierstore-reprobe-{tier.name}", daemon=True).start()
    return future


_VIEW: ProcessLocal[TierHealth] = ProcessLocal(TierHealth)


def view() -> TierHealth:
    """This process's view (a forked child makes its own)."""
    return _VIEW.get()


def said_once(tier: Probed) -> int:
    """The level at which an operation logs that ``tier`` failed it: DEBUG while the view holds
    the tier unreachable (the view said so, once for the process), else WARNING."""
    return logging.DEBUG if view().is_open(tier) else logging.WARNING
