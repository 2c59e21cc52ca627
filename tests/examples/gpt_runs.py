"""Run ``examples/train_gpt.py`` under torchrun as real process trees, and read its loss log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_gpt.py"
SCHEDULE = ("--steps", "200", "--save-every", "4")
"""Every run shares the LR schedule's length, so a stopped, killed or resumed run is comparable."""


@dataclass
class Run:
    """One training job's configuration and run directory (its loss log lives there)."""

    root: Path
    name: str = "run"

    @property
    def config(self) -> Path:
        return self.root / "tierstore.yaml"

    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    def write_config(self, tiers: list[dict[str, Any]]) -> None:
        """The YAML file every process of the run reads."""
        self.root.mkdir(parents=True, exist_ok=True)
        document = {"namespace": "gpt", "tiers": tiers, "promote": {"every": 1}}
        self.config.write_text(yaml.safe_dump(document))

    def command(self, nproc: int, *flags: str, launcher: tuple[str, ...] = ()) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *launcher,
            str(TRAIN),
            "--config",
            str(self.config),
            "--run-dir",
            str(self.run_dir),
            *SCHEDULE,
            *flags,
        ]

    def train(self, nproc: int, *flags: str, timeout: float = 240) -> str:
        """Train to completion and return the job's log (stderr); fail the test with the job's
        output if it fails."""
        done = subprocess.run(
            self.command(nproc, *flags),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(),
            check=False,
        )
        assert done.returncode == 0, f"training failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        return done.stderr

    def start(self, nproc: int, *flags: str, launcher: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        """Start training in the background (torchrun and its workers)."""
        return subprocess.Popen(
            self.command(nproc, *flags, launcher=launcher),
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill_9(self) -> None:
        """SIGKILL torchrun and every worker of this run (workers sit in sessions of their own)."""
        needle = str(self.run_dir).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if needle in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue

    def records(self) -> list[dict[str, Any]]:
        """Every line of the loss log."""
        lines = (self.run_dir / "loss.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def starts(self) -> list[dict[str, Any]]:
        """The ``start`` record of every attempt, oldest first."""
        return [r for r in self.records() if r["event"] == "start"]

    def losses(self, attempt: int = -1) -> dict[int, float]:
        """``step -> loss`` of one attempt (default: the last)."""
        wanted = self.starts()[attempt]["attempt"]
        return {
            r["step"]: r["loss"] for r in self.records() if r["event"] == "step" and r["attempt"] == wanted
        }

    def samples(self, attempt: int = -1) -> dict[int, int]:
        """``step -> global samples seen after it`` of one attempt."""
        wanted = self.starts()[attempt]["attempt"]
        return {
            r["step"]: r["samples_seen"]
            for r in self.records()
            if r["event"] == "step" and r["attempt"] == wanted
        }


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 10 ms until true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TIERSTORE_NODE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def two_tiers(root: Path) -> list[dict[str, Any]]:
    """A memory tier per simulated node, and a local-disk tier below it."""
    return [
        {"name": "ram", "type": "memory", "path": str(root / "ram" / "{node}"), "keep": 3},
        {"name": "local", "type": "local", "path": str(root / "local"), "keep": 6},
    ]


def new_run(root: Path) -> Run:
    """A run with :func:`two_tiers` under ``root``."""
    run = Run(root)
    run.write_config(two_tiers(root))
    return run


def promote_once(run: Run) -> None:
    """One promoter pass, as the sidecar would make."""
    subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(run.config), "promote", "--once"],
        check=True,
        capture_output=True,
        env=_env(),
    )
