"""Restoring: :class:`TieredReader` (:mod:`.reader` shows DCP's call order), the tier choice."""

from tierstore.dcp.restore.choice import Choice, choose_copy
from tierstore.dcp.restore.metadata import load_metadata
from tierstore.dcp.restore.reader import TieredReader

__all__ = ["Choice", "TieredReader", "choose_copy", "load_metadata"]
