"""The example trainer's answer to a configuration that does not load: one line, not a traceback
per rank."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.examples.gpt_runs import Run, _env


def test_a_config_typo_is_one_line_naming_the_key_under_torchrun(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.write_config([{"name": "ram", "type": "memory", "path": str(tmp_path / "ram"), "keeep": 2}])
    done = subprocess.run(
        run.command(2), capture_output=True, text=True, timeout=240, env=_env(), check=False
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("train_gpt.py: error: ")]
    assert len(ours) == 1, done.stderr
    assert "keeep" in ours[0] and str(run.config) in ours[0], ours[0]
    assert 'File "' + str(Path("examples") / "train_gpt.py") not in done.stderr, "no trainer traceback"
    assert "ValidationError" not in done.stderr and "tierstore/config.py" not in done.stderr
    assert not (tmp_path / "ram").exists(), "nothing was started"
