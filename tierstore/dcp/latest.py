"""``latest_committed``: the checkpoint a restarting job should restore, the same on every rank."""

from __future__ import annotations

import os

import torch.distributed as dist

from tierstore.catalog import Catalog
from tierstore.config import Config
from tierstore.dcp.collectives import broadcast_object
from tierstore.errors import TierstoreError
from tierstore.topology import is_distributed


def latest_committed(
    config: Config | str | os.PathLike[str],
    *,
    node: int | None = None,
    collective: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> str | None:
    """The newest checkpoint id committed in any tier (see :mod:`tierstore.catalog`), or None.

    With torch.distributed initialised and ``collective=True`` this is a collective: call it on every
    rank; rank 0 decides and broadcasts, so every rank restores the same checkpoint even when their
    node-local tiers differ. Raises :class:`~tierstore.errors.TierstoreError` on every rank when
    rank 0 could not decide.
    """
    if not (collective and is_distributed()):
        return Catalog(config, node=node).latest()
    answer: tuple[str | None, str | None] = (None, None)
    if dist.get_rank(process_group) == 0:
        try:
            answer = (Catalog(config, node=node).latest(), None)
        except Exception as exc:  # noqa: BLE001 - every rank must leave the collective
            answer = (None, f"{type(exc).__name__}: {exc}")
    latest, error = broadcast_object(answer, process_group)
    if error is not None:
        raise TierstoreError(f"finding the latest checkpoint failed on rank 0: {error}")
    return latest  # type: ignore[no-any-return]
