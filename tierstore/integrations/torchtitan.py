"""tierstore as torchtitan's checkpointer (torchtitan 0.3.0): saves through :class:`TieredWriter`,
resumes through :func:`latest_committed` and :class:`TieredReader`.

The one change in a torchtitan config (a ``config_registry`` function)::

    from tierstore.integrations.torchtitan import TieredCheckpointManager

    checkpoint=TieredCheckpointManager.Config(interval=500, ...)   # was CheckpointManager.Config(...)

The trainer is unchanged: it calls ``load(step)``, ``save(curr_step, last_step)``,
``maybe_wait_for_staging()`` and ``close()`` as it does torchtitan's own. How each torchtitan field is
honoured, and where the tierstore YAML comes from: docs/usage.md, "torchtitan".
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from tierstore.config import Config as TierstoreConfig
from tierstore.config import as_config
from tierstore.dcp.manager import default_id
from tierstore.dcp.restore import TieredReader
from tierstore.dcp.save import TieredWriter
from tierstore.dcp.tools import latest_committed
from tierstore.records.catalog import Catalog
from tierstore.records.marker import read_manifest

logger = logging.getLogger(__name__)

MODEL_ONLY = "-model"
"""Suffix of a model-only final save's id: ``step_00000100-model``."""
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


def checkpoint_id(step: int, *, model_only: bool = False) -> str:
    """``step_00000100`` (``step_00000100-model`` for a model-only final save)."""
    return default_id(step) + (MODEL_ONLY if model_only else "")


def _default_tierstore_config() -> str:
    return os.environ.get("TIERSTORE_CONFIG", "tierstore.yaml")


class TieredCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpointer contract (``BaseCheckpointManager``) on tierstore: see the module
    docstring. Built by torchtitan's trainer from :class:`Config` with its runtime objects."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        tierstore_config: str = field(default_factory=_default_tierstore_config)
        """The tierstore YAML (tiers, retention, promotion): ``$TIERSTORE_CONFIG`` or ./tierstore.yaml."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: dcp.save; ``async``: dcp.async_save on a thread; ``async_with_pinned_mem``:
        dcp.async_save in a process, staged by tierstore's overlapped staging."""

        durable_last_save: bool = True
        """Write the final save (``last_step``) into the last tier and confirm its marker there."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode} (expected one of {ASYNC_MODES})")
            if self.last_save_in_hf or self.initial_load_in_hf:
                raise ValueError(
                    "tierstore stores DCP checkpoints: last_save_in_hf and initial_load_in_hf are not"
                    " supported (export the final model with torchtitan's own checkpointer for HF)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future[Any] | None = None
        if not self.enable:
            return
        del sd_adapter, base_folder  # HF conversion is refused; the tiers name where checkpoints live
        self.options = config
        self.tierstore: TierstoreConfig = as_config(config.tierstore_config)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers})
        if lr_schedulers is not None:
            self.states[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.async_mode = config.async_mode
        self.staging_future: Future[Any] | None = None
        # DCP's collectives run on a gloo group of their own: an async save's run from another thread
        # and would interleave with the training's on the default group (NCCL on GPUs).
        self.pg = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self._writer: TieredWriter | None = None
        self._overwrite = False
        self._warn_about_retention(config.keep_latest_k)
        logger.info(
            "tierstore checkpointing active: tiers %s from %s (checkpoint.folder is not used)",
            ", ".join(t.name for t in self.tierstore.tiers),
            self.tierstore.origin,
        )

    def _warn_about_retention(self, keep_latest_k: int) -> None:
        wanted = keep_latest_k or None  # torchtitan's 0 is "keep all", tierstore's absent keep
        keeps = {t.name: self.tierstore.policy(t.name).keep for t in self.tierstore.tiers}
        differ = {name: keep for name, keep in keeps.items() if keep != wanted}
        if differ and self._rank() == 0:
            shown = ", ".join(f"{name}: {keep or 'all'}" for name, keep in keeps.items())
            logger.warning(
                "checkpoint.keep_latest_k=%d is not applied: tierstore keeps each tier's `keep` newest"
                " checkpoints (%s); set `keep` per tier in %s",
                keep_latest_k,
                shown,
                self.tierstore.origin,
            )

    def _rank(self) -> int:
        return dist.get_rank(self.pg) if self.pg is not None else 0

    def writer(self) -> TieredWriter:
        """The writer of the periodic saves, made at the first (staging buffers are reused)."""
        if self._writer is None:
            overlap = True if self.async_mode == "async_with_pinned_mem" else None
            self._writer = TieredWriter(self.tierstore, overwrite=self._overwrite, overlap=overlap)
        return self._writer

    # -- saving ----------------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.options.load_only:
            return False
        if curr_step == 1 and self.options.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _full_states(self, states: dict[str, Any] | None = None) -> dict[str, Any]:
        """torchtitan's layout: the model's keys at the top, beside ``optimizer``, ``lr_scheduler``, ..."""
        states = self.states if states is None else states
        flat = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # one save in flight: its failure surfaces here
        self._maybe_wait_for_staging()
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
        else:
            self._save_periodic(curr_step)
        logger.info("checkpoint at step %d began or done in %.2f s", curr_step, time.monotonic() - begin)
        return True

    def _save_periodic(self, curr_step: int) -> None:
        states, ident, writer = self._full_states(), checkpoint_id(curr_step), self.writer()
        if self.async_mode == "disabled":
            dcp.save(states, storage_writer=writer, checkpoint_id=ident, process_group=self.pg)
            return
        pinned = self.async_mode == "async_with_pinned_mem"
        result = dcp.async_save(
            states,
            storage_writer=writer,
            checkpoint_id=ident,
            process_group=self.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS if pinned else AsyncCheckpointerType.THREAD,
        )
        if isinstance(result, AsyncSaveResponse):  # overlapped staging
            self.staging_future, self.save_future = result.staging_completion, result.upload_completion
        else:
            self.save_future = result
        assert self.save_future is not None
        writer.over_when(self.save_future)

    def _save_last_step(self, curr_step: int) -> None:
        model_only = self.options.last_save_model_only
        if model_only:
            states = {
                k: v.to(self.export_dtype)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
                else v
                for k, v in self.states[MODEL].state_dict().items()
            }
        else:
            states = self._full_states()
        ident = checkpoint_id(curr_step, model_only=model_only)
        if not self.options.durable_last_save:
            dcp.save(states, storage_writer=self.writer(), checkpoint_id=ident, process_group=self.pg)
            return
        last = self.tierstore.tiers[-1].name
        durable = TieredWriter(self.tierstore, tier=last, overwrite=True, overlap=False)
        try:
            dcp.save(states, storage_writer=durable, checkpoint_id=ident, process_group=self.pg)
        finally:
            durable.close()
        if self._rank() == 0:
            tier = self.tierstore.make_tier(last, node=durable.node)
            read_manifest(tier, ident, trust=self.tierstore.marker_trust())  # raises if absent
        logger.info("final checkpoint %s is durable in tier %s", ident, last)

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        if future is not None:
            future.result()

    def _maybe_wait_for_staging(self) -> None:
        future, self.staging_future = self.staging_future, None
        if future is not None:
            future.result()

    # -- loading ---------------------------------------------------------------------------------

    def _committed(self) -> set[str]:
        """The ids committed in any tier, as rank 0 lists them (every rank gets the same answer)."""
        listed: list[Any] = [set(Catalog(self.tierstore).scan()) if self._rank() == 0 else None]
        if self.pg is not None:
            dist.broadcast_object_list(listed, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return set(listed[0])

    def _choose(self, step: int) -> str | None:
        if step == -1:
            return latest_committed(self.tierstore, process_group=self.pg)
        committed = self._committed()
        for ident in (checkpoint_id(step), checkpoint_id(step, model_only=True)):
            if ident in committed:
                return ident
        raise FileNotFoundError(
            f"--checkpoint.load_step={step}: no checkpoint {checkpoint_id(step)} in tierstore"
        )

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        chosen = self._choose(step)
        if step != -1:
            self._overwrite = True  # a rewind: the steps after it are saved again
        if chosen is None:
            return self._initial_load()
        model_only = chosen.endswith(MODEL_ONLY)
        if model_only and step == -1:
            raise ValueError(
                f"the newest checkpoint, {chosen}, holds only the model (the final save of a finished run,"
                " checkpoint.last_save_model_only): there is no training state to resume. Set"
                " checkpoint.load_step to its step to load the model, or to an earlier step to resume"
            )
        begin = time.monotonic()
        reader = TieredReader(self.tierstore)
        states = self._states_to_load(model_only)
        dcp.load(states, storage_reader=reader, checkpoint_id=chosen, process_group=self.pg)
        self.states[MODEL].load_state_dict(states)  # the model's keys were flattened into ``states``
        logger.info("loaded %s from tier %s in %.2f s", chosen, reader.chosen_tier, time.monotonic() - begin)
        return True

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        missing = [k for k in self.options.exclude_from_loading if k not in self.states]
        if missing:
            raise ValueError(f"exclude_from_loading: {missing} not found in the state")
        kept = {k: v for k, v in self.states.items() if k not in self.options.exclude_from_loading}
        return self._full_states(kept)

    def _initial_load(self) -> bool:
        path = self.options.initial_load_path
        if not path:
            logger.info("no checkpoint in tierstore: a fresh start")
            return False
        states = self._states_to_load(self.options.initial_load_model_only)
        dcp.load(states, checkpoint_id=path, process_group=self.pg)  # a plain DCP directory
        self.states[MODEL].load_state_dict(states)
        logger.info("no checkpoint in tierstore: loaded initial_load_path %s", path)
        return True

    def _close(self) -> None:
        try:
            if self.save_future is not None:
                self._wait_for_saving()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


__all__ = ["MODEL_ONLY", "TieredCheckpointManager", "checkpoint_id"]
