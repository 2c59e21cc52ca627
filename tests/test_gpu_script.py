"""benchmarks/gpu.py, the CUDA benchmark of issue 39, is ready for a GPU: its whole path runs here on
CPU tensors (``--cpu``), and without CUDA and without ``--cpu`` it refuses in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmark_runs_its_whole_path_on_cpu_tensors(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--cpu",
            "--size",
            "8MiB",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["restore_bit_exact"] is True
    assert set(result["median_seconds"]) == {"torch best", "tierstore", "tierstore overlapped"}
    assert set(result["targets"]) == {"stall / torch best stall", "overlapped return / torch best stall"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the benchmark runs")
def test_without_cuda_it_says_so_and_how_to_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "no CUDA device here" in done.stderr and "--cpu" in done.stderr
