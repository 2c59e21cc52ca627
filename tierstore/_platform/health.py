"""This process's view of its tiers' health: one circuit breaker per tier, for every operation.

A tier that leaves a question unanswered within ``probe_timeout``, or whose client reports an outage
(:class:`~tierstore.errors.TierUnavailableError` with ``outage`` set), is *open*: every later question
of this process is answered at once as unreachable, so a restart pays a sick tier's deadline once. A
question to an open tier starts a background probe (one in flight per tier, never a write), at most
once per ``probe_timeout`` (at least :data:`RETRY_AFTER`); its answer closes the breaker. The node's
processes share verdicts (:mod:`tierstore._platform.node_verdicts`); tiers are told apart by
:attr:`Probed.health_key`, not by name. The whole contract: docs/design.md, "The health view".
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

from tierstore._platform import node_verdicts
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
    found_by: str = ""
    """Who found it away, where another process of this node did (for messages)."""
    shared: bool = False
    """A verdict of this node stands for it (:mod:`tierstore._platform.node_verdicts`)."""


class TierHealth:
    """The circuit breakers of this process's tiers (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}

    def check(self, tier: Probed, timeout: float) -> None:
        """Return if ``tier`` may be asked; else raise :class:`TierUnavailableError` at once, or,
        when a probe is due, once the probe it starts has not answered within ``timeout``."""
        key = tier.health_key
        period = max(timeout, RETRY_AFTER)
        with self._lock:
            state = self._open.get(key)
            if state is None:
                state = self._from_node(tier)
                if state is None:
                    return
            elif state.shared and not node_verdicts.present(key):  # another process found it back
                self._close(tier, "a probe of another process of this node found it back")
                return
            if state.probe is not None and state.probe.done():
                if state.probe.exception() is None:
                    self._close(tier, "")
                    return
                state.probe = None
            now = time.monotonic()
            started = None
            if state.probe is None and now - state.probed_at >= period:
                verdict = node_verdicts.read(key) if state.shared else None
                if verdict is not None and verdict.age < period:
                    state.probed_at = now - verdict.age  # another process of the node probed since
                else:
                    state.probed_at = now
                    state.probe = started = _probe(tier)
            away = now - state.since
        if started is not None and state.found_by:
            # Away by the node's verdict, not by this process's own finding: the probe answers in
            # the background (a restart's ranks do not each wait for a tier one of them found
            # hung), and renews the verdict for the node when it finds the tier away again.
            _renew_unless_answered(started, key, state.reason, timeout)
        elif started is not None:
            # The question that starts a probe waits for its answer (within the deadline): a tier
            # back since must serve it, or a process asking rarely (a restore after a blip) would
            # fail each time. A hung tier's probe stays in flight: no later question waits.
            wait([started], timeout=timeout)
            with self._lock:
                if self._open.get(key) is not state:  # another question closed it meanwhile
                    return
                if started.done() and started.exception() is None:
                    self._close(tier, "")
                    return
                if state.shared:  # the node waits a period before it probes again
                    node_verdicts.write(key, state.reason)
        raise TierUnavailableError(
            f"tier {tier.name}: skipped, unreachable for {away:.0f}s ({state.reason}{state.found_by});"
            " this process asks it again once a background probe finds it back",
            tier=tier.name,
            outage=True,
        )

    def _from_node(self, tier: Probed) -> _Open | None:
        """The breaker opened from this node's verdict on ``tier`` (None when there is none): a
        process that finds the tier away in another's verdict neither asks nor waits (lock held)."""
        verdict = node_verdicts.read(tier.health_key)
        if verdict is None:
            return None
        found = time.monotonic() - verdict.age
        by = f"; found by process {verdict.pid} of this node {verdict.age:.0f}s ago"
        state = self._open[tier.health_key] = _Open(verdict.reason, found, found, found_by=by, shared=True)
        logger.warning(
            "tier %s is unreachable (%s%s): this process skips it until a background probe finds it back",
            tier.name,
            verdict.reason,
            by,
        )
        return state

    def _close(self, tier: Probed, how: str) -> None:
        """``tier`` answers again: every question of this process (and, with the verdict removed,
        of this node) reaches it (lock held)."""
        del self._open[tier.health_key]
        if not how:
            node_verdicts.clear(tier.health_key)
        said = f" ({how})" if how else ""
        logger.info("tier %s answers again%s: this process asks it again", tier.name, said)

    def failed(self, tier: Probed, error: BaseException) -> None:
        """``tier`` did not answer (``error``): open its breaker; the first time, say so (one
        WARNING line for the whole process)."""
        reason = one_line(str(error))
        with self._lock:
            if tier.health_key in self._open:
                return
            now = time.monotonic()
            shared = node_verdicts.write(tier.health_key, reason)
            self._open[tier.health_key] = _Open(reason, now, now, shared=shared)
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


def _renew_unless_answered(probe: Future[object], key: str, reason: str, timeout: float) -> None:
    """Renew the node's verdict on the tier of ``key`` unless ``probe`` answers within ``timeout``."""

    def renew() -> None:
        if not probe.done() or probe.exception() is not None:
            node_verdicts.write(key, reason)

    timer = threading.Timer(timeout, renew)
    timer.daemon = True
    timer.start()


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
