"""A promoter's first pass reads every marker of a tier it lists (minutes at 10,000 retained on a
real store): that listing is long, not hung. Its deadline is on progress (each directory walked,
each page listed, each marker read), so a tier whose first listing outlasts ``probe_timeout`` is
not taken for unreachable. Measured on SeaweedFS at 10,000 retained x 4 tiers before: every tier
was, and the node's verdict file passed that on to the node's other processes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.simulated_job import layout, manifest_for
from tests.tiers.dict_tier import FAULTS
from tierstore.config import config_from_dict
from tierstore.promote.sidecar import Promoter

NAMESPACE = "long"
RETAINED = 400
VERB = 0.03
"""Seconds each verb of the store takes: 400 markers, 16 at a time, about 0.8 s in all."""
PROBE_TIMEOUT = 0.3


@pytest.fixture
def slow_store() -> Iterator[str]:
    store = f"slow-{uuid.uuid4().hex[:8]}"
    yield store
    FAULTS.slow.pop(store, None)


def test_a_first_listing_longer_than_probe_timeout_leaves_the_tier_reachable(slow_store: str) -> None:
    config = config_from_dict(
        {
            "namespace": NAMESPACE,
            "probe_timeout": f"{PROBE_TIMEOUT}s",
            "tiers": [
                {"name": "ram", "type": "nodedict", "store": f"{slow_store}-ram-{{node}}"},
                {"name": "durable", "type": "dict", "store": slow_store},
            ],
        }
    )
    durable = config.make_tiers(node=0)[1]
    for index in range(1, RETAINED + 1):
        for path, data in layout(manifest_for(index, 1, NAMESPACE)):
            durable.write_bytes(path, data)
    FAULTS.slow[slow_store] = VERB
    promoter = Promoter(config)
    try:
        started = time.monotonic()
        promoter.run_once()
        took = time.monotonic() - started
        assert promoter.view.unreachable == {}, promoter.view.unreachable
        assert len(promoter.view.found["durable"]) == RETAINED
        assert took > 2 * PROBE_TIMEOUT, f"the pass took {took:.2f} s: not longer than the deadline"
    finally:
        promoter.context.keepers.release()
