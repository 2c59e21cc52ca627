"""Retries for object-store calls: a value-like policy wrapped around idempotent operations only.

Transient means: throttling (``SlowDown``, HTTP 429/503), other 5xx answers, and connection or timeout
errors. The decision reads the structured error (HTTP status, S3 error code) that botocore attaches,
never the message text. Waits are jittered exponential; the total is bounded in attempts and time.
"""

from __future__ import annotations

import asyncio
import logging
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
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
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
        return status >= 500 or status == 429 or code in _THROTTLING
    return any(isinstance(error, _CONNECTION_ERRORS) for error in causes(exc))


def is_connection_failure(exc: BaseException) -> bool:
    """True when no HTTP answer came back at all (refused, unreachable, timed out)."""
    return s3_error(exc) is None and is_transient(exc)


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
    ) -> T:
        """Run ``operation`` (which must be idempotent), retrying transient failures."""

        def before_sleep(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            logger.warning(
                "retrying %s after attempt %d failed: %s", what, state.attempt_number, error
            )
            if on_retry is not None and error is not None:
                on_retry(error)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts)
            | tenacity.stop_after_delay(self.max_time),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(operation)
