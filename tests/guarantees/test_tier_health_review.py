"""The health view's breaker must not cost an operation that the tier could answer: faults found by
review of the per-process tier-health view (``tierstore/_platform/health.py``).

Real components only: moto's S3 server behind the loopback fault proxy (``tests/fault_proxy.py``),
and local files for tiers whose question itself raises.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from tests.guarantees.test_tier_health import PROBE_TIMEOUT, write_config
from tierstore import load_config
from tierstore._platform import health
from tierstore._platform.bounded import Prober


def test_a_question_that_raises_timeout_error_itself_is_not_a_missed_deadline(tmp_path: Path) -> None:
    """``Prober.ask`` raises a question's own errors as they are, and only an outage opens the
    breaker. A read that fails at once with ``TimeoutError`` (``ETIMEDOUT`` from a soft NFS mount,
    a socket timeout) was taken for the prober's own deadline: reported as "no answer within 2s",
    and the tier skipped by every later question of the process."""
    config = load_config(write_config(tmp_path, "http://127.0.0.1:9", f"ask-{uuid.uuid4().hex[:12]}"))
    tier = config.make_tier("s3", node=0)
    prober = Prober(PROBE_TIMEOUT)

    def question() -> None:
        raise TimeoutError(110, "Connection timed out")

    began = time.monotonic()
    try:
        prober.ask(tier, question, what="read a file")
    except TimeoutError as exc:
        raised: BaseException = exc
    assert type(raised) is TimeoutError and raised.args == (110, "Connection timed out"), raised
    assert time.monotonic() - began < PROBE_TIMEOUT / 2
    assert not health.view().is_open(tier)
    assert prober.ask(tier, lambda: 42) == 42


def test_watch_raises_a_works_own_timeout_error_as_it_is(tmp_path: Path) -> None:
    """Likewise ``Prober.watch`` (verify's reads): a work that raises ``TimeoutError`` itself."""
    config = load_config(write_config(tmp_path, "http://127.0.0.1:9", f"watch-{uuid.uuid4().hex[:12]}"))
    tier = config.make_tier("s3", node=0)

    def work(progress: object) -> None:
        raise TimeoutError(110, "Connection timed out")

    try:
        Prober(PROBE_TIMEOUT).watch(tier, work, what="verify x")
    except TimeoutError as exc:
        raised: BaseException = exc
    assert type(raised) is TimeoutError and raised.args == (110, "Connection timed out"), raised
    assert not health.view().is_open(tier)
