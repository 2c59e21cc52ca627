"""deploy/kubernetes/base/train.sh, the trainer container's PID 1, run for real under fake
``torchrun`` and ``tierstore`` executables: the kubelet's SIGTERM reaches torchrun once, the drain
runs after torchrun has exited, and the container keeps torchrun's status (a non-zero one makes the
Job recreate the index, which resumes), even when the SIGTERM comes just as torchrun exits."""

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


RACING_TORCHRUN = """#!/bin/bash
trap : TERM  # the SIGTERM train.sh forwards: torchrun handles it, and its status stays its own
# Once train.sh traps SIGTERM (bit 15 of its caught-signal mask), the kubelet's SIGTERM reaches it
# just as torchrun exits.
until (( 16#$(awk '$1 == "SigCgt:" {print $2}' "/proc/${PPID}/status") & 1 << 14 )); do
  kill -0 "${PPID}" 2>/dev/null || exit 99  # train.sh is gone: no orphan left polling
  sleep 0.01
done
kill -TERM "${PPID}" && echo "sent" >>"${EVENTS}"
exit "${STATUS}"
"""
QUICK_TIERSTORE = """#!/bin/bash
exit 0
"""


def container_env(tmp_path: Path, torchrun: str, tierstore: str) -> dict[str, str]:
    """The trainer container's environment, with ``torchrun`` and ``tierstore`` (script texts)
    first on PATH and their events going to ``tmp_path/events``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("torchrun", torchrun), ("tierstore", tierstore)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "EVENTS": str(tmp_path / "events"),
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


def test_sigterm_reaches_torchrun_once_then_the_drain_runs_and_the_status_is_kept(tmp_path: Path) -> None:
    env, events = container_env(tmp_path, TORCHRUN, TIERSTORE), tmp_path / "events"
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


def test_the_status_is_torchruns_when_the_sigterm_comes_as_torchrun_exits(tmp_path: Path) -> None:
    """bash's ``wait`` can reap a child and run a trap before it records the child's status, and
    then returns 128+signal: a SIGTERM from the kubelet just as torchrun exits 0 after its save
    would fail the pod with 143. Each round here, torchrun exits with its own status as the SIGTERM
    reaches train.sh, a few rounds at once: the container's status must be torchrun's every time.
    The train.sh that waited on the running torchrun exited 143 in 93 to 104 of 120 here (five runs)."""
    env = container_env(tmp_path, RACING_TORCHRUN, QUICK_TIERSTORE)
    rounds, at_once = 120, 4
    statuses = [(round_ * 37) % 128 for round_ in range(rounds)]  # 0 among them
    got: list[int | None] = []
    for start in range(0, rounds, at_once):
        containers = [
            subprocess.Popen(
                ["bash", str(TRAIN_SH)],
                env={**env, "STATUS": str(status)},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for status in statuses[start : start + at_once]
        ]
        for container in containers:
            try:
                got.append(container.wait(timeout=30))
            except subprocess.TimeoutExpired:
                os.killpg(container.pid, signal.SIGKILL)
                container.wait()
                got.append(None)
    wrong = [
        (round_, want, had)
        for round_, (want, had) in enumerate(zip(statuses, got, strict=True))
        if want != had
    ]
    assert not wrong, f"(round, torchrun's status, the container's) in {len(wrong)} of {rounds}: {wrong}"
    sent = (tmp_path / "events").read_text().splitlines()
    assert sent == ["sent"] * rounds, "a SIGTERM did not reach train.sh: the race was not tried"
