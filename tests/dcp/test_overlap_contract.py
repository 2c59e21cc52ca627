"""What torch 2.13's ``async_save`` does with a stager whose ``stage()`` returns a future, which
overlapped saves rely on. If torch changes it, these fail loudly (see ``tierstore.dcp.staging.overlap``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.dcp.staging.overlap import StagingFuture


class FixedStager(AsyncStager):
    """A stager whose ``stage()`` returns a future made beforehand."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self.synchronized = False

    def stage(self, state_dict: dict[str, Any]) -> Future[Any]:
        return self.future

    def synchronize_staging(self) -> None:
        self.synchronized = True


def failed(future: Future[Any]) -> Future[Any]:
    future.set_exception(ValueError("staging failed early"))
    return future


def save_with(stager: FixedStager, config: Config) -> AsyncSaveResponse:
    response = dcp.async_save(
        {"w": torch.ones(3)},
        storage_writer=TieredWriter(config),
        async_stager=stager,
        checkpoint_id="step_0001",
    )
    assert isinstance(response, AsyncSaveResponse), "a future from stage(): both futures back"
    assert not stager.synchronized, "synchronize_staging is never called for a staging future"
    return response


def test_torch_reports_an_already_failed_staging_future_as_staged(make_config: Callable[..., Config]) -> None:
    """The quirk StagingFuture works around: should this fail, torch fixed it; drop the override."""
    response = save_with(FixedStager(failed(Future())), make_config("local"))
    assert response.staging_completion.result() is None
    with pytest.raises(ValueError, match="staging failed early"):
        response.upload_completion.result()


def test_a_failed_staging_future_fails_staging_completion_however_early(
    make_config: Callable[..., Config],
) -> None:
    future = failed(StagingFuture())
    assert not future.done(), "a failure reads as not done, so torch attaches its callback"
    response = save_with(FixedStager(future), make_config("local"))
    with pytest.raises(ValueError, match="staging failed early"):
        response.staging_completion.result()
    with pytest.raises(ValueError, match="staging failed early"):
        response.upload_completion.result()


def test_a_staging_future_is_done_once_it_succeeded() -> None:
    future = StagingFuture()
    assert not future.done()
    future.set_result({"w": 1})
    assert future.done() and future.result() == {"w": 1}
