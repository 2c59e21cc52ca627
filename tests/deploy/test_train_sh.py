"""deploy/kubernetes/base/train.sh, the trainer container's PID 1, run for real under fake
``torchrun`` and ``tierstore`` executables: the kubelet's SIGTERM reaches torchrun once, the drain
runs after torchrun has exited, and the container keeps torchrun's non-zero status (so the Job
recreates the index, which resumes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.deploy.tools import DEPLOY

TRAIN_SH = DEPLOY / "kubernetes" / "base" / "train.sh"
TORCHRUN = """#!/bin/bash
echo "torchrun start" >>"${EVENTS}"
signalled=0
trap 'echo "torchrun got TERM" >>"${EVENTS}"; signalled=1' TERM
for ((i = 0; i < 600; i++)); do
  [ "${signalled}" = 1 ] && break
  sleep 0.1
done
sleep 1  # the final save
echo "torchrun exit 1" >>"${EVENTS}"
exit 1  # torchrun's status after a handled signal, though every worker saved
"""
TIERSTORE = """#!/bin/bash
echo "drain start $*" >>"${EVENTS}"
sleep 0.3
echo "drain exit 0" >>"${EVENTS}"
"""


def test_sigterm_reaches_torchrun_once_then_the_drain_runs_and_the_status_is_kept(tmp_path: Path) -> None:
    bin_dir, events = tmp_path / "bin", tmp_path / "events"
    bin_dir.mkdir()
    for name, text in (("torchrun", TORCHRUN), ("tierstore", TIERSTORE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "EVENTS": str(events),
        "NNODES": "1",
        "NPROC_PER_NODE": "1",
        "TIERSTORE_NODE": "0",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29500",
        "RUN_DIR": str(tmp_path / "run"),
        "STEPS": "10",
        "SAVE_EVERY": "5",
        "GLOBAL_BATCH": "8",
        "MICRO_BATCH": "8",
    }
    container = subprocess.Popen(
        ["bash", str(TRAIN_SH)],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while "torchrun start" not in (events.read_text() if events.exists() else ""):
            assert time.monotonic() < deadline and container.poll() is None, container.communicate()
            time.sleep(0.05)
        started = time.monotonic()
        container.send_signal(signal.SIGTERM)  # the kubelet, to PID 1
        time.sleep(0.3)
        container.send_signal(signal.SIGTERM)  # a second one must not reach torchrun again
        _, err = container.communicate(timeout=60)
    finally:
        if container.poll() is None:
            os.killpg(container.pid, signal.SIGKILL)
            container.communicate()
    lines = events.read_text().splitlines()
    assert lines.count("torchrun got TERM") == 1, lines
    order = [
        next(i for i, x in enumerate(lines) if re.match(p, x))
        for p in ("torchrun got TERM", "torchrun exit", "drain start", "drain exit 0")
    ]
    assert order == sorted(order), lines
    assert "--config /etc/tierstore/tierstore.yaml promote --once" in lines[order[2]]
    assert container.returncode == 1, err
    assert time.monotonic() - started < 10
