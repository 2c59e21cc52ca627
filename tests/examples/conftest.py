"""The uninterrupted reference run every exact-resume test compares with (run once per session)."""

from __future__ import annotations

import pytest

from tests.examples.gpt_runs import new_run


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of 16 uninterrupted steps on 2 ranks."""
    run = new_run(tmp_path_factory.mktemp("reference"))
    run.train(2, "--stop-after", "16")
    losses = run.losses()
    assert sorted(losses) == list(range(1, 17))
    return losses
