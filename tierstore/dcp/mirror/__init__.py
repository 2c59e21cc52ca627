"""Peer mirror over ``torch.distributed`` (gloo): the exchange after a save, and peer restore."""

from tierstore.dcp.mirror.groups import job_groups
from tierstore.dcp.mirror.inventory import OWN, stored_path
from tierstore.dcp.mirror.peer_read import fetch_missing
from tierstore.dcp.mirror.rounds import ExchangeWaits, Round, SavedShare, worker_for

__all__ = ["ExchangeWaits", "Round", "SavedShare", "job_groups", "worker_for"]  # the writer's
__all__ += ["OWN", "fetch_missing", "stored_path"]  # the restore's and export's
