"""``tierstore drill`` against the example: restore in a separate job, train, compare with the log.

One training run (2 ranks, 20 steps) feeds every test: steps 1-16 are promoted to S3, steps 17-20
are only logged, as when a drill runs behind a live job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.examples.gpt_runs import REPO, TRAIN, Run, _env

pytestmark = pytest.mark.timeout(600)
ENTRY = f"{TRAIN}:drill_entry"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Run:
    import boto3

    bucket = f"drill-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("drill")
    run = Run(root)
    run.write_config(
        [
            {"name": "ram", "type": "memory", "path": str(root / "ram" / "{node}"), "keep": 8},
            {
                "name": "s3",
                "type": "s3",
                "url": f"s3://{bucket}/ckpt",
                "endpoint_url": s3_endpoint,
                "keep": 10,
            },
        ]
    )
    run.train(2, "--stop-after", "16")
    tierstore(run, "promote", "--once")
    run.train(2, "--stop-after", "20")  # newer than anything in S3: logged, not promoted
    return run


def tierstore(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "--config", str(run.config), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )


def drill(run: Run, *flags: str) -> tuple[int, dict[str, Any]]:
    """Run a drill with --json; return its exit code and report."""
    done = tierstore(
        run,
        "drill",
        "--entry",
        ENTRY,
        "--loss-log",
        str(run.run_dir / "loss.jsonl"),
        "--json",
        *flags,
        "--",
        "--config",
        str(run.config),
        "--steps",
        "200",
    )
    assert done.stdout.strip(), f"no report: {done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout)


def test_drill_restores_the_newest_durable_checkpoint_and_matches_the_log(
    trained: Run, tmp_path: Path
) -> None:
    prom = tmp_path / "drill.prom"
    code, report = drill(trained, "--world-size", "2", "--steps", "3", "--prom-file", str(prom))

    assert code == 0, report["reason"]
    assert (report["checkpoint_id"], report["tier"], report["passed"]) == ("step_00000016", "s3", True)
    assert report["steps"] == [17, 18, 19]
    assert report["losses"] == report["logged"]  # same world size: bit for bit
    assert report["max_relative_error"] == 0.0
    assert list(report["bytes_read"]) == ["s3"] and report["bytes_read"]["s3"] > 1_000_000
    assert 0 < report["restore_s"] <= report["rto_s"]
    lines = prom.read_text().splitlines()
    assert lines[0] == ('tierstore_drill_success{checkpoint_id="step_00000016",tier="s3",world_size="2"} 1')
    assert any(line.startswith("tierstore_drill_rto_seconds{") for line in lines)


def test_drill_at_another_world_size_passes_within_its_tolerance(trained: Run) -> None:
    code, report = drill(
        trained, "--checkpoint", "step_00000012", "--world-size", "1", "--tolerance", "0.01", "--tier", "ram"
    )
    assert code == 0, report["reason"]
    assert report["tier"] == "ram" and report["steps"] == [13, 14, 15]
    # One rank draws the dropout masks two ranks drew: close to the log, not equal to it.
    assert 0 < report["max_relative_error"] <= 0.01


def test_drill_fails_a_checkpoint_whose_optimizer_state_was_dropped(trained: Run) -> None:
    script = REPO / "tests" / "examples" / "drop_optimizer_state.py"
    saved = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(trained.config),
            "step_00000012",
            "step_00000012-no-optim",
            "s3",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert saved.returncode == 0, saved.stderr[-4000:]

    code, report = drill(trained, "--checkpoint", "step_00000012-no-optim", "--world-size", "2")

    assert code == 1 and not report["passed"]
    assert len(report["losses"]) >= 2, f"the drill stopped before two steps: {report['reason']}"
    # The first step's loss comes before any update: it still matches. The update then differs.
    assert report["losses"][0] == report["logged"][0]
    assert report["losses"][1] != report["logged"][1]
    assert "step 14" in report["reason"]


def test_a_failing_step_function_fails_the_drill_naming_the_rank(trained: Run) -> None:
    done = tierstore(
        trained,
        "drill",
        "--entry",
        ENTRY,
        "--checkpoint",
        "step_00000012",
        "--loss-log",
        str(trained.run_dir / "loss.jsonl"),
        "--",
        "--no-such-flag",
    )
    assert done.returncode == 1
    assert "drill FAIL" in done.stdout and "rank 0" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--entry", "no_such_module:f"], "cannot import no_such_module"),
        (["--entry", f"{TRAIN}:no_such_function"], "has no function 'no_such_function'"),
        (["--entry", "nocolon"], "expected module:function"),
        (["--entry", ENTRY, "--tier", "tape"], "no tier named 'tape'"),
        (["--entry", ENTRY, "--checkpoint", "../x"], "../x"),
        (["--entry", ENTRY, "--tolerance", "nan"], "--tolerance nan"),
        (["--entry", ENTRY, "--timeout", "0"], "--timeout 0"),
    ],
)
def test_bad_drill_arguments_are_clear_errors(trained: Run, flags: list[str], message: str) -> None:
    done = tierstore(trained, "drill", "--loss-log", str(trained.run_dir / "loss.jsonl"), *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_a_missing_loss_log_is_a_clear_error(trained: Run, tmp_path: Path) -> None:
    done = tierstore(trained, "drill", "--entry", ENTRY, "--loss-log", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2 and "none.jsonl" in done.stderr


def test_drill_fails_a_checkpoint_with_a_corrupted_byte(trained: Run) -> None:
    generation = next((trained.root / "ram" / "0" / "gpt" / "step_00000008").glob("g*"))
    data = generation / "r00000-0.distcp"
    with open(data, "r+b") as handle:
        handle.seek(64)  # the first tensor's first byte
        byte = handle.read(1)
        handle.seek(64)
        handle.write(bytes([byte[0] ^ 0x01]))

    code, report = drill(trained, "--tier", "ram", "--checkpoint", "step_00000008", "--world-size", "2")

    assert code == 1 and not report["passed"]
    assert "r00000-0.distcp" in report["reason"], report["reason"]


def test_drill_fails_when_the_entry_restores_another_checkpoint(trained: Run) -> None:
    entry = f"{REPO / 'tests' / 'examples' / 'other_id_entry.py'}:restores_step_4"
    done = tierstore(
        trained,
        "drill",
        "--entry",
        entry,
        "--checkpoint",
        "step_00000012",
        "--loss-log",
        str(trained.run_dir / "loss.jsonl"),
        "--json",
        "--",
        "--config",
        str(trained.config),
        "--steps",
        "200",
    )
    report = json.loads(done.stdout)
    assert done.returncode == 1
    assert "restored step_00000004, not the drill's step_00000012" in report["reason"]


def test_a_rank_that_reported_is_not_lost_to_gloo_teardown_at_exit(trained: Run) -> None:
    # Without the drill's own exit the job aborted in about three runs of four; two runs make a
    # pass by luck unlikely.
    entry = f"{REPO / 'tests' / 'examples' / 'gloo_leftover_entry.py'}:leaves_work_in_flight"
    for _ in range(2):
        done = tierstore(
            trained,
            "drill",
            "--entry",
            entry,
            "--checkpoint",
            "step_00000012",
            "--world-size",
            "2",
            "--loss-log",
            str(trained.run_dir / "loss.jsonl"),
            "--json",
            "--",
            "--config",
            str(trained.config),
            "--steps",
            "200",
        )
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["passed"], report["reason"]


def test_by_default_the_drill_takes_the_newest_checkpoint_the_log_can_judge(trained: Run) -> None:
    # The memory tier's newest is step 20, the last logged step: nothing to compare after it.
    code, report = drill(trained, "--tier", "ram", "--world-size", "2")
    assert code == 0, report["reason"]
    assert report["checkpoint_id"] == "step_00000016" and report["steps"] == [17, 18, 19]
