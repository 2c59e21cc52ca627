"""``TieredReader``: a DCP ``StorageReader`` that restores from the fastest usable committed copy.

Call order (torch.distributed.checkpoint 2.13, see ``StorageReader``; ``dcp.load``):

1. all ranks: :meth:`TieredReader.reset` (only when ``dcp.load`` gets a ``checkpoint_id``).
2. all ranks, inside DCP's collective wrapper: :meth:`~TieredReader.read_metadata` chooses the tier
   collectively, announcing the restore in each tier it looks at (:mod:`tierstore.dcp.restore.choice`,
   :mod:`tierstore.dcp.restore.session`), then returns DCP's ``.metadata`` from it, checked against the
   marker's CRC32C and unpickled with an allowlist (:mod:`tierstore.dcp.restore.metadata`).
3. all ranks: :meth:`~TieredReader.set_up_storage_reader`, then the plans
   (:meth:`~TieredReader.prepare_local_plan`, coordinator :meth:`~TieredReader.prepare_global_plan`):
   nothing storage-specific.
4. all ranks: :meth:`~TieredReader.read_data` reads the rank's items, each checked against its CRC32C
   (:mod:`tierstore.dcp.restore.data`, :mod:`tierstore.dcp.restore.items`,
   :mod:`tierstore.dcp.restore.objects`).

Reads go straight into the destination tensors when they can (``preadv`` on POSIX tiers into a
contiguous CPU tensor that takes a whole stored chunk); otherwise the bytes are read and copied. Files
are read in parallel. Resharding (another world size than the save's) is DCP's planner's job: the reader
only serves byte ranges, so it works from any tier.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierstore._platform.bounded import Prober
from tierstore.config import Config, as_config
from tierstore.dcp.collectives import ALONE
from tierstore.dcp.restore import data as restore_data
from tierstore.dcp.restore import metadata as restore_metadata
from tierstore.dcp.restore.session import RestoreSession
from tierstore.errors import TierstoreError
from tierstore.ids import is_checkpoint_id, validate_checkpoint_id
from tierstore.tiers import Tier
from tierstore.topology import current_node


class TieredReader(StorageReader):
    """Load DCP checkpoints from the fastest tier holding a usable committed copy.

    Args:
        config: a loaded :class:`~tierstore.config.Config` or the path of a YAML file.
        checkpoint_id: the id to load when ``dcp.load`` is called without one.
        node: this process's node index for node-local tiers (default: :func:`current_node`).
        verify: check every file's CRC32C before choosing a tier (default: ``verify_on_load``).
        process_group: the group passed to ``dcp.load`` (default: the default group).
        collective: False when this process loads alone in a job whose other ranks do not load
            (``dcp.load(..., no_dist=True)``): the tier is then chosen by this process alone, and a
            mirrored memory tier serves only what this node holds. DCP tells a reader nothing of
            ``no_dist``, so without this the load waits in a collective the other ranks never join.

    Raises (through DCP): :class:`~tierstore.errors.CheckpointNotFoundError` listing every tier and
    why it was skipped; :class:`~tierstore.errors.IntegrityError` for a corrupt ``.metadata``.
    """

    def __init__(
        self,
        config: Config | str | os.PathLike[str],
        *,
        checkpoint_id: str | None = None,
        node: int | None = None,
        verify: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        collective: bool = True,
    ) -> None:
        super().__init__()
        self.config = as_config(config)
        self.node = current_node(node)
        self.trust = self.config.marker_trust()
        # With the job's key, every file is checked against its signed SHA-256 before the tier is
        # chosen: a tier writer could otherwise swap a data file whose byte items DCP unpickles.
        signing = self.trust.keys is not None
        self.verify = (self.config.verify_on_load if verify is None else verify) or signing
        self.collective = collective
        self.process_group = process_group if collective else ALONE
        self._checkpoint_id = None if checkpoint_id is None else validate_checkpoint_id(checkpoint_id)
        self._tiers: list[Tier] | None = None
        self._bytes_done = 0  # by the loads before this session's
        self._prober = Prober(self.config.probe_timeout)
        self._session: RestoreSession | None = None  # the load in progress, or the last one

    @property
    def checkpoint_id(self) -> str | None:
        """The id being (or to be) loaded."""
        return self._checkpoint_id

    @property
    def chosen_tier(self) -> str | None:
        """The name of the tier the last load read from (None before a load)."""
        return self._session.tier.name if self._session and self._session.tier else None

    @property
    def bytes_read(self) -> int:
        """Bytes this reader read from storage (``.metadata`` and data), over all its loads."""
        return self._bytes_done + (self._session.bytes_read if self._session is not None else 0)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when ``checkpoint_id`` is a valid tierstore id."""
        return isinstance(checkpoint_id, str) and is_checkpoint_id(checkpoint_id)

    def tiers(self) -> list[Tier]:
        """Every configured tier, fastest first, as seen from this node."""
        if self._tiers is None:
            self._tiers = self.config.make_tiers(node=self.node)
        return self._tiers

    # -- 1. the checkpoint ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Select the checkpoint to load (validated)."""
        if self._session is not None:  # a previous load that failed before read_data
            self._session.stop_reading()
            self._bytes_done += self._session.bytes_read
            self._session = None
        if checkpoint_id is not None:
            self._checkpoint_id = validate_checkpoint_id(checkpoint_id)

    # -- 2. the tier and its metadata -------------------------------------------------------------

    def read_metadata(self, *args: Any, **_ignored: Any) -> Metadata:
        """Choose the tier (collectively) and return DCP's metadata from it."""
        if self._checkpoint_id is None:
            raise TierstoreError("no checkpoint id: pass checkpoint_id= to dcp.load or TieredReader")
        previous = self._session
        self._bytes_done += previous.bytes_read if previous is not None else 0
        self._session = RestoreSession(
            config=self.config,
            tiers=self.tiers(),
            node=self.node,
            verify=self.verify,
            trust=self.trust,
            collective=self.collective,
            process_group=self.process_group,
            prober=self._prober,
            checkpoint_id=self._checkpoint_id,
            # Called again without a reset (DCP's optimizer helpers): the first call's records stay.
            reading=previous.reading if previous is not None else {},
            tier=previous.tier if previous is not None else None,
        )
        return restore_metadata.read_metadata(self._session)

    # -- 3. set-up and plans ----------------------------------------------------------------------

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item locations of the chosen copy."""
        if self._session is not None:
            self._session.storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    # -- 4. the data ------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` from the chosen tier, in parallel, each checked against its
        CRC32C; the future is complete when it returns."""
        if self._session is None:
            raise TierstoreError("read_data() before read_metadata()")
        return restore_data.read_data(self._session, plan, planner)
