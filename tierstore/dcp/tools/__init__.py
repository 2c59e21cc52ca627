"""Tools over committed checkpoints: the latest one, an export to torch's format, a restore drill."""

from tierstore.dcp.tools.drill import DrillReport, run_drill
from tierstore.dcp.tools.export import ExportReport, export_checkpoint
from tierstore.dcp.tools.latest import latest_committed

__all__ = ["DrillReport", "ExportReport", "export_checkpoint", "latest_committed", "run_drill"]
