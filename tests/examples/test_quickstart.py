"""``make demo``: the README's first command runs the main job on the embedded S3 server and says
what it leaves behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_runs_and_says_it_removed_its_checkpoints_and_how_to_keep_them() -> None:
    demo = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr[-4000:]
    said = re.search(r"removed the demo's checkpoints \((\S+), (\S+)\); --keep keeps them", demo.stdout)
    assert said is not None, demo.stdout[-2000:]
    assert not Path(said[1]).exists() and not Path(said[2]).exists()
    assert "restored step_" in demo.stderr and "done in" in demo.stdout  # the reader logs its restores
