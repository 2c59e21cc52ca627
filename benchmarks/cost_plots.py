"""Plot what ``benchmarks/costs.py`` counted: requests and time per operation as a job grows.

    python benchmarks/cost_plots.py bench-results/costs.json [more costs.json ...] [--out costs.png]

One figure, four panels: S3 requests plus file operations, and seconds, each against retained
checkpoints (8 ranks) and against files per checkpoint (10 retained), one line per operation, both
axes logarithmic. Several inputs are merged point by point (a later file's point replaces an
earlier one's at the same size), so a long run of the 10,000 point can join a shorter ``make bench``
run. A flat line is a cost that does not grow with the job; a line parallel to the diagonal grows in
proportion.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

OPERATIONS = (
    "latest_committed",
    "restore tier choice",
    "promoter idle pass",
    "promoter full-scan pass",
    "tierstore ls",
    "protocol save to s3",
    "dcp.save to s3",
    "promoter first pass",
)
"""The operations plotted (``ls --limit 0`` is left out: it is only measured up to 1,000)."""

AXES = {"retained": "retained checkpoints (8 ranks)", "ranks": "files per checkpoint (10 retained)"}


def merged(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every sweep's rows from ``paths``, one per size, later files winning, sorted by size."""
    sweeps: dict[str, dict[int, dict[str, Any]]] = {axis: {} for axis in AXES}
    for path in paths:
        body = json.loads(path.read_text())
        for axis in AXES:
            for row in body.get(axis, []):
                sweeps[axis][int(row[axis])] = row
    return {axis: [rows[size] for size in sorted(rows)] for axis, rows in sweeps.items()}


def requests(cell: dict[str, Any]) -> int:
    """What an operation asked of the tiers: S3 requests and counted file operations."""
    return int(cell["s3"]) + int(cell["file_ops"])


def plot(sweeps: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """Write the four panels to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(2, 2, figsize=(13, 9), constrained_layout=True)
    for column, (axis, label) in enumerate(AXES.items()):
        rows = sweeps[axis]
        for op in OPERATIONS:
            points = [(row[axis], row[op]) for row in rows if row.get(op)]
            if not points:
                continue
            sizes = [size for size, _ in points]
            panels[0][column].plot(sizes, [max(requests(c), 1) for _, c in points], "o-", label=op)
            panels[1][column].plot(sizes, [max(c["seconds"], 1e-4) for _, c in points], "o-", label=op)
        for row_index, unit in enumerate(("S3 requests + file operations", "seconds")):
            panel = panels[row_index][column]
            panel.set_xscale("log")
            panel.set_yscale("log")
            panel.set_xlabel(label)
            panel.set_ylabel(unit)
            panel.grid(True, which="both", alpha=0.3)
    panels[0][0].legend(fontsize=8)
    figure.suptitle("tierstore: cost per operation as the job grows (benchmarks/costs.py)")
    figure.savefig(out, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="costs.json files of costs.py")
    parser.add_argument("--out", type=Path, default=Path("bench-results/costs.png"))
    args = parser.parse_args()
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)} (run benchmarks/costs.py first)")
    sweeps = merged(args.inputs)
    if not any(sweeps.values()):
        parser.error("the inputs hold no 'retained' or 'ranks' rows of costs.py")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(sweeps, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
