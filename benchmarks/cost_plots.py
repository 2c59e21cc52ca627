"""Plot what ``benchmarks/costs.py`` counted: requests and time per operation as a job grows.

    python benchmarks/cost_plots.py bench-results/costs.json [more ...] [fleet.json] [--out costs.png]

One figure, four panels: S3 requests plus file operations, and seconds, each against retained
checkpoints (8 ranks) and against files per checkpoint (10 retained), one line per operation, both
axes logarithmic. Several inputs are merged point by point (a later file's point replaces an
earlier one's at the same size), so a long run of the 10,000 point can join a shorter ``make bench``
run. A flat line is a cost that does not grow with the job; a line parallel to the diagonal grows in
proportion.

A ``fleet.json`` of ``benchmarks/fleet.py`` among the inputs adds a second figure, ``fleet.png`` beside
``--out``: the S3 requests per second of one node's promoter, and of all N, against N, with S3's
per-prefix limits.
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


def fleet_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """The rows of every ``fleet.json`` among ``paths``, one per node count, later files winning."""
    rows: dict[int, dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(path.read_text()).get("fleet", []):
            rows[int(row["nodes"])] = row
    return [rows[n] for n in sorted(rows)]


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


def reads(by_kind: dict[str, float]) -> float:
    """LIST plus GET/HEAD: what S3's 5,500 per second per prefix counts."""
    return by_kind["LIST"] + by_kind["GET/HEAD"]


def plot_fleet(rows: list[dict[str, Any]], out: Path) -> None:
    """Write ``fleet.py``'s rates to ``out`` (PNG): per node, and all nodes against S3's limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (per_node, total) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    nodes = [row["nodes"] for row in rows]
    lines = (  # panel, whose rates, what of them, colour, label
        (per_node, "watcher", reads, "C0", "a watcher"),
        (per_node, "keeper", reads, "C1", "the keeper"),
        (total, "all nodes", reads, "C0", "LIST+GET/HEAD"),
        (total, "all nodes", lambda k: k["PUT/DELETE"], "C3", "PUT/DELETE"),
    )
    for case, style in (("ready", "o-"), ("late", "s--")):
        for panel, who, pick, color, label in lines:
            values = [max(pick(r["rates"][f"{who} ({case})"]), 1e-2) for r in rows]
            panel.plot(nodes, values, style, color=color, label=f"{label} ({case})")
    for value, label in (
        (5500, "S3: 5,500 GET/HEAD per prefix"),
        (3500, "S3: 3,500 PUT/DELETE per prefix"),
        (100, "target: 100 LIST+GET"),
    ):
        total.axhline(value, linestyle=":", color="grey")
        total.annotate(label, (nodes[0], value), textcoords="offset points", xytext=(2, 3), fontsize=8)
    per_node.set_ylabel("LIST+GET/HEAD per second, one node's promoter")
    total.set_ylabel("requests per second, all nodes")
    for panel in (per_node, total):
        panel.set_xscale("log")
        panel.set_yscale("log")
        panel.set_xlabel("nodes (promoters)")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend(fontsize=8)
    retained = ", ".join(f"{r['nodes']}: {r['retained']}" for r in rows)
    when = rows[0].get("schedule") or {}
    figure.suptitle(
        f"tierstore: requests to one job-wide S3 tier (benchmarks/fleet.py; retained at N nodes {retained};"
        f" interval {when.get('interval')} s, lease {when.get('lease')} s,"
        f" a change every {when.get('change')} s)",
        fontsize=9,
    )
    figure.savefig(out, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "inputs", nargs="+", type=Path, help="costs.json files of costs.py, fleet.json of fleet.py"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/costs.png"))
    args = parser.parse_args()
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)} (run benchmarks/costs.py first)")
    sweeps, fleet = merged(args.inputs), fleet_rows(args.inputs)
    if not any(sweeps.values()) and not fleet:
        parser.error("the inputs hold no 'retained' or 'ranks' rows of costs.py, nor fleet.py's")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if any(sweeps.values()):
        plot(sweeps, args.out)
        print(f"wrote {args.out}")
    if fleet:
        plot_fleet(fleet, args.out.with_name("fleet.png"))
        print(f"wrote {args.out.with_name('fleet.png')}")


if __name__ == "__main__":
    main()
