"""Saving: :class:`TieredWriter` (:mod:`.writer` shows DCP's call order), gates, the plan messages."""

from tierstore.dcp.save.gate import GateView, LossBandGate
from tierstore.dcp.save.session import RankAssignment, RankFiles, RankReport
from tierstore.dcp.save.writer import TieredWriter

__all__ = ["GateView", "LossBandGate", "RankAssignment", "RankFiles", "RankReport", "TieredWriter"]
