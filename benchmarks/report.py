"""Render a benchmark run (``bench.json``) as the Markdown tables of docs/performance.md.

python benchmarks/report.py bench-results/bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.tables import figure_table, ratio_table  # after the path is set


def render(report: dict[str, Any]) -> str:
    """Markdown: the figures (median, min-max, GiB/s), then the ratios against their targets; the
    sweep, the peer-mirror phase and the goodput loop in tables of their own."""
    machine = report["machine"]
    args = report["arguments"]
    mirror = report["extra"].get("mirror") or {}
    apart = set(mirror.get("figures", [])) | set(mirror.get("ratios", []))
    figures = [name for name in report["results"] if name not in apart]
    ratios = [name for name in report["ratios"] if name not in apart]
    lines = [
        f"One run of `make bench` on this machine ({machine['cores']} cores, {machine['platform']},"
        f" torch {machine['torch']}); state {args['size']}, median of {args['reps']} rounds"
        f" ({args['s3_reps']} for S3)."
    ]
    if figures:
        lines += ["", *figure_table(report, figures)]
    if ratios:
        lines += ["", *ratio_table(report, ratios)]
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
    if mirror:
        from benchmarks.mirror import markdown as mirror_markdown

        lines += ["", mirror_markdown(report)]
    if report.get("goodput"):
        from benchmarks.goodput import markdown

        lines += ["", markdown(report["goodput"])]
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/bench.json")
    print(render(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
