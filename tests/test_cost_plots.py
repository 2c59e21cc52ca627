"""``benchmarks/cost_plots.py``: the plot of what ``benchmarks/costs.py`` counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "cost_plots.py"


def _cell(s3: int, files: int, seconds: float) -> dict[str, float]:
    return {"s3": s3, "file_ops": files, "seconds": seconds}


def _row(axis: str, size: int, s3: int) -> dict[str, object]:
    return {axis: size, "latest_committed": _cell(0, 29, 0.01), "promoter idle pass": _cell(s3, 46, 0.1)}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_merges_runs_and_writes_a_png(tmp_path: Path) -> None:
    short = tmp_path / "short.json"
    short.write_text(
        json.dumps(
            {
                "retained": [_row("retained", 10, 16), _row("retained", 1000, 22)],
                "ranks": [_row("ranks", 8, 16)],
            }
        )
    )
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"retained": [_row("retained", 10000, 16)]}))
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import cost_plots
    finally:
        sys.path.remove(str(SCRIPT.parent))
    sweeps = cost_plots.merged([short, long])
    assert [r["retained"] for r in sweeps["retained"]] == [10, 1000, 10000]
    assert [r["ranks"] for r in sweeps["ranks"]] == [8]
    replaced = tmp_path / "again.json"
    replaced.write_text(json.dumps({"retained": [_row("retained", 1000, 99)]}))
    again = cost_plots.merged([short, replaced])
    assert again["retained"][1]["promoter idle pass"]["s3"] == 99  # the later file wins
    out = tmp_path / "costs.png"
    result = _run(str(short), str(long), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("content", "expected"), [(None, "no such file"), ("{}", "no 'retained' or 'ranks' rows")]
)
def test_bad_input_is_named(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    result = _run(str(path), "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert expected in result.stderr
    assert str(path) in result.stderr or content is not None


def _events(**gets: float) -> dict[str, dict[str, object]]:
    """Counts per event as ``benchmarks/fleet.py`` summarises them: ``gets`` GET/HEAD each, no LIST."""
    names = {
        "watcher_pass": "watcher pass",
        "lease": "watcher lease read",
        "ready": "watcher change, index ready",
        "late": "watcher change, indexed late",
        "keeper_pass": "keeper pass",
        "renewal": "keeper renewal",
        "keeper_change": "keeper pass after a change",
    }
    return {names[k]: {"kinds": {"LIST": 0.0, "GET/HEAD": v, "PUT/DELETE": 0.0}} for k, v in gets.items()}


def test_fleet_rates_compose_the_counts_per_event_for_the_schedule_and_are_plotted(tmp_path: Path) -> None:
    """A watcher: nothing per pass, 1 GET per lease read (30 s), and 1 more per change it learns (at
    most one per lease read, though the tier changes every 20 s), the same when it is learnt a lease late.
    The keeper: 1 GET per pass (10 s), 3 per renewal (3 a lease), 5 more per change (20 s)."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.fleet import Schedule, rates
    finally:
        sys.path.remove(str(ROOT))
    events = _events(watcher_pass=0, lease=1, ready=2, late=2, keeper_pass=1, renewal=3, keeper_change=6)
    composed = rates(events, 1250, Schedule())
    keeper = 1 / 10 + 3 * 3 / 30 + 5 / 20
    assert composed["watcher (ready)"]["GET/HEAD"] == pytest.approx(2 / 30, abs=1e-4)
    assert composed["watcher (late)"]["GET/HEAD"] == pytest.approx(2 / 30, abs=1e-4)
    assert composed["keeper (ready)"]["GET/HEAD"] == pytest.approx(keeper, abs=1e-4)
    assert composed["all nodes (ready)"]["GET/HEAD"] == pytest.approx(1249 * 2 / 30 + keeper, abs=0.01)
    assert composed["all nodes (ready)"]["LIST"] == 0
    rarely = rates(events, 1250, Schedule(change=120))  # a change every fourth lease read
    assert rarely["watcher (ready)"]["GET/HEAD"] == pytest.approx(1 / 30 + 1 / 120, abs=1e-4)

    fleet = tmp_path / "fleet.json"
    rows = [{"nodes": n, "retained": 1000, "rates": rates(events, n, Schedule())} for n in (8, 1250)]
    fleet.write_text(json.dumps({"fleet": rows}))
    out = tmp_path / "costs.png"
    result = _run(str(fleet), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert not out.exists(), "no costs.py rows: no costs.png"
    assert (tmp_path / "fleet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
