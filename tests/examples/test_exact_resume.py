"""Exact resume of ``examples/train_gpt.py``: a killed, resumed, rolled-back or resized run continues
as if nothing had happened. Real torchrun jobs (gloo on loopback), real ``kill -9``.

The reference is one uninterrupted 2-rank run of 16 steps; every other run uses the same schedule, so
its per-step losses must equal the reference's bit for bit (deterministic CPU kernels, one thread per
rank), except across a world-size change, where they must stay within the measured noise band.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.examples.gpt_runs import new_run, promote_once, wait_for
from tierstore.ids import marker_path

pytestmark = pytest.mark.timeout(600)


def test_killed_and_resumed_run_repeats_the_losses_bit_for_bit(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = new_run(tmp_path)
    job = run.start(2)  # the full 200-step schedule: it is surely still running when killed
    try:
        committed = tmp_path / "ram" / "0" / "gpt" / marker_path("step_00000008")
        wait_for(committed.exists, 180, "step 8 to commit")
    finally:
        run.kill_9()
        job.wait(30)
    crashed_at = max(run.losses())
    assert crashed_at < 200, "the job was not killed mid-run"

    run.train(2, "--stop-after", "16")

    resumed = run.starts()[-1]
    assert resumed["resumed_from"] is not None
    resumed_step = resumed["step"]
    assert 8 <= resumed_step <= crashed_at
    after = run.losses()
    assert sorted(after) == list(range(resumed_step + 1, 17))
    assert after == {step: reference[step] for step in after}  # bit for bit
    assert run.samples()[16] == 16 * 16


def test_resume_after_the_memory_tier_is_wiped_reads_the_next_tier(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = new_run(tmp_path)
    first = run.train(2, "--stop-after", "8", "--async-mode", "process")
    promote_once(run)
    shutil.rmtree(tmp_path / "ram")  # the node rebooted: host memory is gone

    second = run.train(2, "--stop-after", "16", "--async-mode", "process")

    resumed = run.starts()[-1]
    assert (resumed["resumed_from"], resumed["tier"]) == ("step_00000008", "local")
    # The job's log says what it decided, once (rank 0), and tierstore's lines say why.
    assert first.count("train_gpt: no committed checkpoint: starting fresh") == 1, first[-3000:]
    assert "no committed checkpoint this job can restore in tiers ram, local" in first
    assert second.count("train_gpt: resumed from step_00000008, tier local, in ") == 1, second
    assert "latest committed checkpoint: step_00000008, restorable from tier local" in second
    assert run.losses() == {step: reference[step] for step in range(9, 17)}


def test_rollback_continues_the_new_timeline_even_after_a_restart(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = new_run(tmp_path)
    run.train(2, "--stop-after", "16")

    run.train(2, "--resume-from", "step_00000008", "--stop-after", "10")
    assert run.starts()[-1]["resumed_from"] == "step_00000008"
    assert run.losses() == {9: reference[9], 10: reference[10]}

    # The rolled-back run committed after step 16 did: a restart continues from its step 10.
    run.train(2, "--stop-after", "12")
    assert run.starts()[-1]["resumed_from"] == "step_00000010"
    assert run.losses() == {11: reference[11], 12: reference[12]}


def test_resume_at_a_smaller_world_size_stays_in_the_noise_band(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    # The noise band: the largest loss difference of two uninterrupted runs, at 2 ranks and at 1
    # (the same global batch by gradient accumulation). They differ by reduction order and dropout
    # streams only.
    alone = new_run(tmp_path / "alone")
    alone.train(1, "--stop-after", "16")
    band = max(abs(alone.losses()[s] - reference[s]) for s in range(1, 17))
    assert 0 < band < 0.05 * reference[16], f"implausible noise band {band}"

    run = new_run(tmp_path / "resized")
    run.train(2, "--stop-after", "8")
    run.train(1, "--stop-after", "16")

    resumed = run.starts()[-1]
    assert (resumed["resumed_from"], resumed["world_size"]) == ("step_00000008", 1)
    assert resumed["samples_seen"] == 8 * 16  # continues at the right sample offset
    assert run.samples() == {s: 16 * s for s in range(9, 17)}
    after = run.losses()
    worst = max(abs(after[s] - reference[s]) for s in range(9, 17))
    # One pair of runs estimates the band; 1.5x leaves room for that estimate's own spread.
    assert worst <= 1.5 * band, f"resumed at 1 rank: off by {worst}, band {band}"
    # A run that restarted from scratch instead would be far outside it.
    assert abs(alone.losses()[1] - reference[9]) > 10 * band


def test_after_a_rollback_losing_the_fast_tier_never_brings_back_the_abandoned_timeline(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run = new_run(tmp_path)
    run.train(2, "--stop-after", "16")
    promote_once(run)  # the abandoned timeline's steps 12 and 16 now sit in the local tier too

    run.train(2, "--resume-from", "step_00000008", "--stop-after", "10")  # step 10: memory only
    shutil.rmtree(tmp_path / "ram")  # the node is replaced before any promotion

    run.train(2, "--stop-after", "12")
    resumed = run.starts()[-1]
    assert (resumed["resumed_from"], resumed["tier"]) == ("step_00000008", "local")
    assert run.losses() == {s: reference[s] for s in range(9, 13)}
