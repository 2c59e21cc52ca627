"""Asking a tier something with a deadline: a slow or hung tier costs the process the deadline once.

A tier that refuses connections fails fast by itself; one that accepts and never answers (a hung
filesystem, an S3 endpoint behind a broken proxy) would hold the caller for as long as its client's
own timeouts and retries allow (minutes). So questions to tiers go through a :class:`Prober`: the
question runs on a daemon thread; after the deadline the caller gets
:class:`~tierstore.errors.TierUnavailableError` naming the tier and the deadline, and the thread is left
to end when the client gives up. Every prober of the process shares one view of the tiers' health
(:mod:`tierstore._platform.health`): a tier that did not answer, or whose client reported an outage,
is skipped at once by every later question of the process, whichever operation asks, until a
background probe finds it back. A hung tier never accumulates threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import TypeVar

from tierstore._platform import health
from tierstore._platform.health import Probed
from tierstore.errors import TierUnavailableError

T = TypeVar("T")


class Prober:
    """Runs questions to tiers with a deadline (see the module docstring). Thread-safe."""

    def __init__(self, timeout: float) -> None:
        """``timeout``: seconds a question may take (the YAML's ``probe_timeout``)."""
        self.timeout = timeout

    def ask(
        self,
        tier: Probed,
        question: Callable[[], T],
        *,
        what: str = "",
        on_late: Callable[[T], object] | None = None,
        direct: bool = False,
        anyway: bool = False,
    ) -> T:
        """``question()``, or :class:`TierUnavailableError` if it does not answer in time, or at
        once if this process found ``tier`` unreachable (see :mod:`tierstore._platform.health`).

        Errors ``question`` raises are raised as they are (an outage also opens the tier's
        breaker). ``what`` describes the question for the message (``"list the commit log"``).
        ``on_late`` is called with the answer if it comes after the deadline (to undo what the
        asker gave up on: a record it no longer holds). ``direct``: ask on this thread, without a
        deadline nor the health view (host memory: it cannot hang, and a thread per question costs
        more than the answer). ``anyway``: ask within the deadline even while the view holds
        ``tier`` unreachable (a question whose skipping is unsafe: the read record of a copy that
        another process of the job read the marker of, and that this one reads).
        """
        if direct:
            return question()
        view = health.view()
        if not anyway:
            view.check(tier, self.timeout)
        future = _on_a_thread(question, f"tierstore-probe-{tier.name}")
        # Waited for apart from its outcome: a TimeoutError the question raises itself (ETIMEDOUT
        # of a soft mount) is its own error, raised as it is, not this deadline.
        if wait([future], timeout=self.timeout).done:
            return _outcome(future, tier)
        if on_late is not None:
            late = on_late

            def undo(done: Future[T]) -> None:
                if done.exception() is None:
                    late(done.result())

            future.add_done_callback(undo)
        doing = f" to {what}" if what else ""
        raise _unanswered(tier, view, f"no answer{doing} within {self.timeout:g}s") from None

    def watch(
        self,
        tier: Probed,
        work: Callable[[Callable[[int], None]], T],
        *,
        what: str,
        blame: Blame | None = None,
    ) -> T:
        """``work(progress)`` on a daemon thread for as long as it makes progress: it calls
        ``progress(n)`` as it goes, and ``timeout`` seconds without a call (or before the first)
        is a hung tier: :class:`TierUnavailableError`, and the health view's verdict, for ``tier``
        or for the one ``blame`` names. For work whose length has no deadline of its own (a
        verification reading a large copy)."""
        view = health.view()
        view.check(tier, self.timeout)
        beat = [time.monotonic()]

        def progress(_count: int) -> None:
            beat[0] = time.monotonic()

        def watched() -> T:
            _watched.progress = progress  # what beat() on this thread reports to
            return work(progress)

        future = _on_a_thread(watched, f"tierstore-watch-{tier.name}")
        while not wait([future], timeout=max(0.0, beat[0] + self.timeout - time.monotonic())).done:
            if time.monotonic() - beat[0] >= self.timeout and not future.done():  # done just now: use it
                culprit = tier if blame is None else blame.culprit(tier)
                raise _unanswered(culprit, view, f"no progress to {what} for {self.timeout:g}s")
        return _outcome(future, tier)


class Blame:
    """Which tier watched work that stopped was waiting on: ``other`` while a call into it is under
    way on some thread of the work (:meth:`into_other`: a promotion's read of its source), else the
    tier it is watched on (its target)."""

    def __init__(self, other: Probed) -> None:
        self.other = other
        self._calls = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def into_other(self) -> Iterator[None]:
        """Around a call into :attr:`other`."""
        with self._lock:
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1

    def culprit(self, watched: Probed) -> Probed:
        """The tier to hold unreachable now."""
        return self.other if self._calls else watched


_watched = threading.local()


def beat(count: int = 1) -> None:
    """Progress of the work :meth:`Prober.watch` runs on this thread, told from below the seam (a
    page of a listing, a directory walked): a listing that takes long at scale is progress, not a
    hung tier. Called anywhere else, nothing."""
    beats_here()(count)


def beats_here() -> Callable[[int], None]:
    """:func:`beat` of this thread, for the threads its work fans out to (marker reads)."""
    progress: Callable[[int], None] | None = getattr(_watched, "progress", None)
    return unwatched if progress is None else progress


def unwatched(_count: int) -> None:
    """The progress of work nobody watches."""


def _unanswered(tier: Probed, view: health.TierHealth, missed: str) -> TierUnavailableError:
    """The error for a tier that missed its deadline (``missed`` says which), told to the view."""
    error = TierUnavailableError(
        f"tier {tier.name}: {missed} (probe_timeout); treated as unreachable", tier=tier.name, outage=True
    )
    view.failed(tier, error)
    return error


def _on_a_thread(call: Callable[[], T], name: str) -> Future[T]:
    """``call()`` on a daemon thread; its answer or error in the future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the asker
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _outcome(future: Future[T], tier: Probed) -> T:
    """A finished question's answer, or its error; an outage it reports opens the tier's breaker."""
    try:
        return future.result()
    except TierUnavailableError as exc:
        if exc.outage:
            health.view().failed(tier, exc)
        raise
