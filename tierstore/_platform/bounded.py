"""Asking a tier something with a deadline: a slow or hung tier costs the asker at most the deadline.

A tier that refuses connections fails fast by itself; one that accepts and never answers (a hung
filesystem, an S3 endpoint behind a broken proxy) would hold the caller for as long as its client's
own timeouts and retries allow (minutes). Fast paths (a restore from host memory, the start-up look
at the other tiers, the promoter's listing pass) cannot pay that, so they ask through a
:class:`Prober`: the question runs on a daemon thread; after the deadline the caller gets
:class:`~tierstore.errors.TierUnavailableError` naming the tier and the deadline, and the thread is left
to end when the client gives up. While it has not, the same tier is not asked again: the next question
fails at once, so a hung tier never accumulates threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tierstore.errors import TierUnavailableError

T = TypeVar("T")


class Prober:
    """Runs questions to tiers with a deadline (see the module docstring). Thread-safe."""

    def __init__(self, timeout: float) -> None:
        """``timeout``: seconds a question may take (the YAML's ``probe_timeout``)."""
        self.timeout = timeout
        self._lock = threading.Lock()
        self._hung: dict[str, Future[object]] = {}

    def __getstate__(self) -> dict[str, object]:
        return {"timeout": self.timeout}  # a copy in another process has nothing in flight

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(float(state["timeout"]))  # type: ignore[misc, arg-type]

    def ask(
        self,
        tier_name: str,
        question: Callable[[], T],
        *,
        what: str = "",
        on_late: Callable[[T], object] | None = None,
        direct: bool = False,
    ) -> T:
        """``question()``, or :class:`TierUnavailableError` if it does not answer in time.

        Errors ``question`` raises are raised as they are. ``what`` describes the question for the
        message (``"list the commit log"``). ``on_late`` is called with the answer if it comes
        after the deadline (to undo what the asker gave up on: a record it no longer holds).
        ``direct``: ask on this thread, without a deadline (host memory: it cannot hang, and a
        thread per question costs more than the answer).
        """
        if direct:
            return question()
        with self._lock:
            pending = self._hung.get(tier_name)
            if pending is not None and not pending.done():
                raise TierUnavailableError(
                    f"tier {tier_name}: still no answer to an earlier request after more than"
                    f" {self.timeout:g}s (probe_timeout); not asked again until it answers",
                    tier=tier_name,
                )
            self._hung.pop(tier_name, None)
        future: Future[object] = Future()

        def run() -> None:
            try:
                future.set_result(question())
            except BaseException as exc:  # noqa: BLE001 - handed to the asker
                future.set_exception(exc)

        threading.Thread(target=run, name=f"tierstore-probe-{tier_name}", daemon=True).start()
        try:
            return future.result(self.timeout)  # type: ignore[return-value]
        except TimeoutError:
            with self._lock:
                self._hung[tier_name] = future
            if on_late is not None:
                late = on_late

                def undo(done: Future[object]) -> None:
                    if done.exception() is None:
                        late(done.result())  # type: ignore[arg-type]

                future.add_done_callback(undo)
            doing = f" to {what}" if what else ""
            raise TierUnavailableError(
                f"tier {tier_name}: no answer{doing} within {self.timeout:g}s (probe_timeout);"
                " treated as unreachable",
                tier=tier_name,
            ) from None
