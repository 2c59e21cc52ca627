"""Retries for object-store calls: a value-like policy wrapped around idempotent operations only.

Transient means: throttling (``SlowDown``, HTTP 429/503), other 5xx answers, connection or timeout
errors, and a body damaged on the way (the store's ``BadDigest`` for a request whose checksum does not
match, botocore's checksum error for a response): the bytes we hold are good, so sending or fetching
them again is the cure. The decision reads the structured error (HTTP status, S3 error code) that
botocore attaches, never the message text. Waits are jittered exponential; the total is bounded in
attempts and time, and a call that runs out raises :class:`RetriesExhausted`, which says how many
attempts it made and for how long. A :class:`RetryEpisode` logs the failed attempts of a store's
requests once per outage, not once per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import botocore.exceptions
import tenacity

logger = logging.getLogger(__name__)
T = TypeVar("T")

_THROTTLING = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_DAMAGED_IN_TRANSIT = frozenset({"BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody"})
"""HTTP 400 answers about a request body that arrived other than it was sent."""
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.IncompleteReadError,  # the answer ended before its Content-Length
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,
)
try:  # aiohttp is s3fs's transport; its errors are connection-level
    import aiohttp

    _CONNECTION_ERRORS += (aiohttp.ClientError,)
except ImportError:  # pragma: no cover - s3fs always brings aiohttp
    pass


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``/``__context__``), innermost last."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def s3_error(exc: BaseException) -> tuple[int, str] | None:
    """``(http_status, s3_error_code)`` of the botocore ClientError behind ``exc``, if any."""
    for error in causes(exc):
        if isinstance(error, botocore.exceptions.ClientError):
            response = error.response
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return status, str(response.get("Error", {}).get("Code", ""))
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: throttling, 5xx, connection resets and timeouts."""
    answer = s3_error(exc)
    if answer is not None:
        status, code = answer
        return status >= 500 or status == 429 or code in _THROTTLING | _DAMAGED_IN_TRANSIT
    if any(isinstance(error, botocore.exceptions.FlexibleChecksumError) for error in causes(exc)):
        return True  # a response body that does not match the checksum the store sent with it
    return any(isinstance(error, _CONNECTION_ERRORS) for error in causes(exc))


def is_connection_failure(exc: BaseException) -> bool:
    """True when no HTTP answer came back at all (refused, unreachable, timed out)."""
    return s3_error(exc) is None and any(isinstance(e, _CONNECTION_ERRORS) for e in causes(exc))


class RetriesExhausted(Exception):  # noqa: N818 - reads as what happened, like StopIteration
    """A transient failure that outlived the retry budget; the last error is its ``__cause__``."""

    def __init__(self, what: str, attempts: int, elapsed: float, last: BaseException) -> None:
        super().__init__(f"{what}: gave up after {attempts} attempts in {elapsed:.1f} s: {last}")
        self.what, self.attempts, self.elapsed = what, attempts, elapsed

    @property
    def summary(self) -> str:
        """``"N attempts in T s"``, for an error message that names the failure itself."""
        return f"{self.attempts} attempts in {self.elapsed:.1f} s"


class RetryEpisode:
    """The failed attempts of one store's requests since one last succeeded: an outage, as its log
    tells it. The first retry of an episode is a WARNING, the others DEBUG (an outage of minutes
    retries hundreds of times, and says so once), and the success that ends it one INFO line with
    their count. Thread-safe; one per store and process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed = 0
        self._since = 0.0

    def retrying(self, what: str, attempt: int, error: BaseException | None) -> None:
        """Log that ``what`` is retried after its ``attempt``-th attempt failed with ``error``."""
        with self._lock:
            first = self._failed == 0
            self._failed += 1
            if first:
                self._since = time.monotonic()
        if first:
            logger.warning(
                "retrying %s after attempt %d failed: %s (further retries are logged at DEBUG until"
                " a request succeeds)",
                what,
                attempt,
                error,
            )
        else:
            logger.debug("retrying %s after attempt %d failed: %s", what, attempt, error)

    def succeeded(self, what: str) -> None:
        """``what`` succeeded: an episode in progress ends, with one line saying how long it lasted."""
        with self._lock:
            failed, self._failed = self._failed, 0
        if failed:
            elapsed = time.monotonic() - self._since
            logger.info("%s succeeded after %d failed attempts in %.1f s", what, failed, elapsed)


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff for idempotent calls, bounded by attempts and total time.

    ``on_retry`` (if given to :meth:`call`) is told about each retry, for metrics.
    """

    max_attempts: int = 8
    max_time: float = 120.0
    initial_wait: float = 0.1
    max_wait: float = 10.0

    def call(
        self,
        operation: Callable[[], T],
        *,
        what: str,
        on_retry: Callable[[BaseException], None] | None = None,
        episode: RetryEpisode | None = None,
    ) -> T:
        """Run ``operation`` (which must be idempotent), retrying transient failures, logged through
        ``episode`` (the store's; by default one of this call's own).

        Raises the operation's own error when it is not transient, :class:`RetriesExhausted` (from
        the last error) when a transient one lasted past ``max_attempts`` or ``max_time``.
        """
        attempts = 0
        log = RetryEpisode() if episode is None else episode

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return operation()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            log.retrying(what, state.attempt_number, error)
            if on_retry is not None and error is not None:
                on_retry(error)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_after_delay(self.max_time),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        started = time.monotonic()
        try:
            result = retrying(attempt)
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise RetriesExhausted(what, attempts, time.monotonic() - started, exc) from exc
        log.succeeded(what)
        return result
