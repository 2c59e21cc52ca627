"""Render a benchmark run (``bench.json``) as the Markdown tables of docs/performance.md.

python benchmarks/report.py bench-results/bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def render(report: dict[str, Any]) -> str:
    """Markdown: the figures (median, min-max, GiB/s), then the ratios against their targets."""
    machine = report["machine"]
    args = report["arguments"]
    lines = [
        f"One run of `make bench` on this machine ({machine['cores']} cores, {machine['platform']},"
        f" torch {machine['torch']}); state {args['size']}, median of {args['reps']} rounds"
        f" ({args['s3_reps']} for S3).",
        "",
        "| measurement | median | min - max | GiB/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, figure in report["results"].items():
        rate = f"{figure['gib_per_s']:.2f}" if figure["bytes"] else ""
        lines.append(
            f"| {name} | {figure['median_s']:.3f} s | {figure['min_s']:.3f} - {figure['max_s']:.3f} s"
            f" | {rate} |"
        )
    lines += [
        "",
        "| ratio (median of per-round ratios) | value | target | |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, ratio in report["ratios"].items():
        verdict = {True: "met", False: "missed", None: ""}[ratio["met"]]
        lines.append(f"| {name} | {ratio['value']:.3f} | {ratio['target']} | {verdict} |")
    if report.get("sweep"):
        lines += [
            "",
            "| sweep size | tensors | stall (waiting) | memory commit | local save | files per rank |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in report["sweep"]:
            lines.append(
                f"| {row['size']} | {row['tensors']} | {row['stall_s']:.3f} s ({row['wait_s']:.3f} s)"
                f" | {row['commit_s']:.3f} s | {row['local_save_s']:.3f} s | {row['files_per_rank']} |"
            )
    if report.get("goodput"):
        from benchmarks.goodput import markdown

        lines += ["", markdown(report["goodput"])]
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/bench.json")
    print(render(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
