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
