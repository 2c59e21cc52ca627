"""Markdown tables of a benchmark report's figures and ratios (shared by the report and phases)."""

from __future__ import annotations

from typing import Any


def figure_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Markdown lines: the figures ``names`` (median, min-max, GiB/s)."""
    lines = ["| measurement | median | min - max | GiB/s |", "| --- | ---: | ---: | ---: |"]
    for name in names:
        figure = report["results"][name]
        rate = f"{figure['gib_per_s']:.2f}" if figure["bytes"] else ""
        lines.append(
            f"| {name} | {figure['median_s']:.3f} s | {figure['min_s']:.3f} - {figure['max_s']:.3f} s"
            f" | {rate} |"
        )
    return lines


def ratio_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Markdown lines: the ratios ``names`` against their targets."""
    lines = ["| ratio (median of per-round ratios) | value | target | |", "| --- | ---: | ---: | --- |"]
    for name in names:
        ratio = report["ratios"][name]
        verdict = {True: "met", False: "missed", None: ""}[ratio["met"]]
        lines.append(f"| {name} | {ratio['value']:.3f} | {ratio['target']} | {verdict} |")
    return lines
