"""An adversarial review of the checkpoint manager: each test a reproduction of a problem found in it
(fixed in the same commit), with real tiers, real DCP saves and, across ranks, gloo on loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierstore import CheckpointManager
from tierstore.config import Config


def state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((256,), value)}}


def test_an_overlapped_writer_saves_what_the_state_was_when_maybe_save_returned(
    make_config: Callable[..., Config],
) -> None:
    """With ``overlap=True`` (or the config's ``staging.overlap``) ``dcp.async_save`` returns an
    ``AsyncSaveResponse``, not a future: the manager failed an assertion at the first save (and, run
    with ``python -O``, would have let the trainer modify the state while it was being copied)."""
    config = make_config("memory")
    trained = state(1.0)
    manager = CheckpointManager(config, trained, every_steps=1, overlap=True)
    assert manager.maybe_save(1) is True
    trained["model"]["w"].fill_(2.0)  # the next step: maybe_save has returned, the state may change
    manager.close()
    fresh = state(-1.0)
    again = CheckpointManager(config, fresh, every_steps=1)
    assert again.restore() == 1
    assert torch.equal(fresh["model"]["w"], torch.full((256,), 1.0))
    again.close()
