"""Pre-emption: a stop signal makes train_gpt save at the next agreed step, commit, and exit; the
restart resumes from exactly there. Real torchrun, real signals, forwarded the way torchrun does
(to each worker's whole process group, DCP's checkpoint process included)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.examples.gpt_runs import Run, new_run, wait_for

pytestmark = pytest.mark.timeout(600)
FORWARD = ("--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")


# Both stop signals, each in one mode: SIGUSR1 is what Slurm's time limit sends, SIGTERM what a
# pre-emption, the hard time limit and the kubelet send (train.sh forwards it to torchrun).
@pytest.mark.parametrize(("mode", "stop"), [("process", signal.SIGUSR1), ("thread", signal.SIGTERM)])
def test_a_forwarded_stop_signal_commits_the_next_step_and_the_restart_resumes_there(
    tmp_path: Path, reference: dict[int, float], mode: str, stop: signal.Signals
) -> None:
    run = new_run(tmp_path)
    job = run.start(2, "--async-mode", mode, launcher=FORWARD)
    try:
        # After a periodic save, so DCP's checkpoint process (PROCESS mode) exists and is hit too.
        wait_for(lambda: _committed(run, "step_00000004") and max(_steps(run), default=0) >= 5, 180, "step 5")
        job.send_signal(stop)
        job.wait(180)
    finally:
        run.kill_9()

    records = run.records()
    (stopped,) = [r for r in records if r["event"] == "stop"]
    assert stopped["preempted"] is True and stopped["step"] < 200
    assert _committed(run, f"step_{stopped['step']:08d}")
    # In PROCESS mode the signal also ends DCP's checkpoint process (see examples/gpt/stop.py): a
    # periodic save it was writing may fail, never the final one, which commits a newer state.
    failed = [r["checkpoint"] for r in records if r["event"] == "save_failed"]
    assert all(c < f"step_{stopped['step']:08d}" for c in failed), failed
    assert mode == "process" or not failed, failed

    run.train(2, "--stop-after", str(stopped["step"] + 3))
    resumed = run.starts()[-1]
    assert resumed["resumed_from"] == f"step_{stopped['step']:08d}"
    assert run.losses() == {s: reference[s] for s in run.losses()} and len(run.losses()) == 3


def _steps(run: Run) -> list[int]:
    try:
        return [r["step"] for r in run.records() if r["event"] == "step"]
    except (FileNotFoundError, ValueError):
        return []


def _committed(run: Run, checkpoint: str) -> bool:
    try:
        return any(r.get("checkpoint") == checkpoint and r["event"] == "committed" for r in run.records())
    except (FileNotFoundError, ValueError):
        return False
