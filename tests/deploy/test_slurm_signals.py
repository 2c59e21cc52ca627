"""deploy/slurm/train.sbatch and node.sh, run for real under fake Slurm and torchrun executables
(tests/deploy/fake_slurm.py): every way a run is stopped, with real signals, in the order an
operator relies on."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deploy.contract import ALL_INTERFACES
from tests.deploy.fake_slurm import NODES, Job, start
from tests.deploy.tools import DEPLOY

STOPPED = 75
"""node.sh's status after a stop on a signal, with the final save and the drain done."""


def at(events: list[str], pattern: str) -> int:
    """The index of the first event matching ``pattern``; fails listing the events."""
    found = [i for i, event in enumerate(events) if re.search(pattern, event)]
    assert found, f"no {pattern!r} in {events}"
    return found[0]


def count(events: list[str], pattern: str) -> int:
    return len([e for e in events if re.search(pattern, e)])


def assert_saved_drained_stopped(events: list[str], signal_name: str, job_id: int = 42) -> None:
    """On every node: torchrun signalled once, torchrun exited, the drain ran after it, then the
    promoter stopped; the requeue after all of them."""
    requeue = at(events, rf"^scontrol requeue {job_id}$")
    for node in range(NODES):
        assert count(events, rf"^torchrun node={node} got ") == 1, (
            f"node {node}: torchrun must be signalled once (a second signal cuts its shutdown)"
        )
        signalled = at(events, rf"^torchrun node={node} got {signal_name}$")
        exited = at(events, rf"^torchrun node={node} exit ")
        drained = at(events, rf"^drain node={node} exit 0$")
        stopped = at(events, rf"^promoter node={node} exit 0$")
        assert signalled < exited < at(events, rf"^drain node={node} start$") < drained < requeue
        assert stopped < requeue
    assert count(events, r"^srun got SIGTERM") == 0, "srun turns SIGTERM into SIGKILL"


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Starts train.sbatch under the fakes (:func:`tests.deploy.fake_slurm.start`); kills what is
    left of it after the test."""
    started: list[Job] = []

    def launch_job(job_id: int = 42, **env: str) -> Job:
        started.append(start(tmp_path, job_id, **env))
        return started[-1]

    yield launch_job
    for job in started:
        job.kill()


@pytest.fixture
def job_id() -> Iterator[int]:
    """A job id whose derived ports (rendezvous 20000 + id % 9900, metrics 30000 + id % 2000)
    this test holds, so the scripts must move to the next free ones."""
    for candidate in range(4242, 4342):
        held = []
        try:
            for port in (20000 + candidate % 9900, 30000 + candidate % 2000):
                listener = socket.socket()
                held.append(listener)
                listener.bind(("127.0.0.1", port))
                listener.listen()
        except OSError:
            for listener in held:
                listener.close()
            continue
        yield candidate
        for listener in held:
            listener.close()
        return
    pytest.fail("no job id with both derived ports free here")


def test_sigterm_to_the_batch_shell_saves_drains_stops_the_promoters_then_requeues(
    launch: Callable[..., Job],
) -> None:
    job = launch()
    job.training()
    job.process.send_signal(signal.SIGTERM)  # scancel --batch --signal=TERM
    status, out, _ = job.finish()
    events = job.events()
    assert_saved_drained_stopped(events, "USR1")  # forwarded as SIGUSR1, never as SIGTERM
    assert at(events, r"^srun got SIGUSR1") < at(events, r"^torchrun node=0 got USR1")
    assert status == 0 and "requeueing 42" in out


def test_sigusr1_before_the_time_limit_does_the_same_on_job_derived_free_ports(
    launch: Callable[..., Job], tmp_path: Path, job_id: int
) -> None:
    job = launch(job_id)
    job.training()
    sd_files = sorted((tmp_path / "sd").glob(f"tierstore-{job_id}-*.json"))
    targets = [json.loads(f.read_text())[0]["targets"][0] for f in sd_files]
    job.process.send_signal(signal.SIGUSR1)
    status, _, err = job.finish()
    events = job.events()
    assert_saved_drained_stopped(events, "USR1", job_id)
    assert status == 0
    master = 20000 + job_id % 9900
    assert f"--master-port {master + 1} " in events[at(events, r"^torchrun node=0 start")]
    metrics = 30000 + job_id % 2000
    ports = {
        int(p) for p in re.findall(r"^promoter node=\d start port=(\d+)$", "\n".join(events), re.MULTILINE)
    }
    assert ports and metrics not in ports and min(ports) == metrics + 1
    assert f"port {metrics} is in use here: metrics on {metrics + 1}" in err
    # Prometheus finds each node's port in its file_sd target, removed when the node stops.
    assert len(targets) == NODES and {int(t.rsplit(":", 1)[1]) for t in targets} == ports
    assert not list((tmp_path / "sd").iterdir())


def test_a_preemption_signals_the_steps_not_the_shell_and_the_job_still_requeues(
    launch: Callable[..., Job],
) -> None:
    job = launch()
    job.training()
    job.signal_step(signal.SIGTERM)  # slurmstepd, at a pre-emption's grace time or the time limit
    status, out, _ = job.finish()
    events = job.events()
    assert_saved_drained_stopped(events, "TERM")
    assert status == 0 and f"job step exited with status {STOPPED}" in out


def test_a_plain_scancel_is_not_undone_by_a_requeue(launch: Callable[..., Job]) -> None:
    job = launch()
    job.training()
    # slurmd terminates the job: SIGTERM to every process of every step, the batch step included,
    # so the batch shell's srun gets it too and kills its tasks at once.
    job.signal_step(signal.SIGTERM)
    os.killpg(job.process.pid, signal.SIGTERM)  # the batch shell and its sruns
    status, _, _ = job.finish()
    events = job.events()
    assert at(events, r"^srun got SIGTERM, sends SIGKILL")
    assert count(events, r"^scontrol requeue") == 0
    assert status not in (0, STOPPED)


def test_a_requeue_that_slurm_refuses_ends_the_job_with_the_stop_status(launch: Callable[..., Job]) -> None:
    job = launch(FAKE_REQUEUE_STATUS="1")  # after scontrol update Requeue=0
    job.training()
    job.process.send_signal(signal.SIGUSR1)
    status, _, err = job.finish()
    assert status == STOPPED and "submit again to resume" in err
    assert at(job.events(), r"^drain node=1 exit 0$") < at(job.events(), r"^scontrol requeue")


def test_a_node_whose_promoter_cannot_start_stops_the_step_and_the_job_is_not_requeued(
    launch: Callable[..., Job],
) -> None:
    job = launch(FAKE_PROMOTER_FAILS_ON="1")
    status, _, err = job.finish()
    events = job.events()
    assert status == 78, err
    assert count(events, r"^torchrun node=1 start") == 0, "node 1 trained without a promoter"
    assert at(events, r"^scancel --signal=USR1 42\.0$") > at(events, r"^promoter node=1 exit 2$")
    assert count(events, r"^scontrol requeue") == 0
    assert re.search(r"--metrics-port (\d+): cannot listen on 0\.0\.0\.0:\1:", err), err
    assert "node 1: the promoter could not start" in err


def test_a_promoter_that_dies_during_training_is_restarted_and_says_so(
    launch: Callable[..., Job], tmp_path: Path
) -> None:
    job = launch(FAKE_PROMOTER_DIES_ONCE=str(tmp_path / "died"))
    job.wait_for_event(r"^promoter node=\d exit 1$")
    job.wait_for_event(r"^promoter node=\d start", NODES + 1)
    job.process.send_signal(signal.SIGUSR1)
    status, _, err = job.finish()
    assert status == 0
    assert re.search(r"node \d: the promoter exited with status 1 during training; restart 1", err)
    assert_saved_drained_stopped(job.events(), "USR1")


def test_free_port_skips_a_port_in_use_on_any_address(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::", 0))
        held.listen()
        port = held.getsockname()[1]
        script = f"source {DEPLOY / 'slurm' / 'lib.sh'}; free_port {port}; free_port {port + 1}"
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [str(port + 1), str(port + 1)]


def test_the_promoters_bind_error_names_the_port_and_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "tierstore.yaml"
    config.write_text(f"namespace: t\ntiers:\n  - {{name: ram, type: memory, path: {tmp_path}}}\n")
    with socket.socket() as held:
        held.bind((ALL_INTERFACES, 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tierstore.cli",
                "--config",
                str(config),
                "--node",
                "0",
                "promote",
                "--once",
                "--metrics-port",
                str(port),
                "--metrics-addr",
                ALL_INTERFACES,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    assert result.returncode == 2  # a configuration error: systemd does not restart it
    assert f"--metrics-port {port}: cannot listen on 0.0.0.0:{port}: " in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_free_port_gives_up_naming_the_range_instead_of_climbing_into_the_next(tmp_path: Path) -> None:
    """The rendezvous range (20000 + id % 9900) must never climb into the metrics range (30000 +
    id % 2000), nor that one into the kernel's ephemeral ports: the search stops after 100 ports."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = f"source {DEPLOY / 'slurm' / 'lib.sh'}; PORT_SEARCH=1; free_port {port}"
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no free port in {port}-{port}" in done.stderr


def test_a_drain_and_a_promoter_deaf_to_sigterm_are_killed_and_the_job_still_requeues(
    launch: Callable[..., Job],
) -> None:
    """A hung mount must not hold the stop past its budget: the drain gets DRAIN_TIMEOUT, then
    SIGTERM, then SIGKILL after STOP_GRACE; the promoter SIGTERM, then SIGKILL after STOP_GRACE."""
    job = launch(FAKE_DRAIN_HANGS="1", FAKE_PROMOTER_HANGS="1", DRAIN_TIMEOUT="1", STOP_GRACE="1")
    job.training()
    started = time.monotonic()
    job.process.send_signal(signal.SIGUSR1)
    status, out, err = job.finish(timeout=60)
    events = job.events()
    assert status == 0 and "requeueing 42" in out, err
    assert count(events, r"^drain node=\d got TERM") == NODES
    assert count(events, r"^drain node=\d exit") == 0, "the drains were killed, not finished"
    assert count(events, r"^promoter node=\d exit") == 0, "the promoters were killed"
    assert err.count("did not stop within 1 s of SIGTERM; killing it") == NODES
    assert time.monotonic() - started < 30


def test_a_crash_on_one_node_is_not_requeued_when_the_others_are_stopped_later(
    launch: Callable[..., Job],
) -> None:
    """srun reports the highest task status, and 75 (stopped, saved, drained) is higher than a
    crash's 1: the batch shell asks every node, and a crash ends the job."""
    job = launch(FAKE_CRASH_NODE="1")
    job.wait_for_event(r"^torchrun node=1 exit 1$")
    job.wait_for_event(r"^drain node=1 exit 0$")
    job.process.send_signal(signal.SIGUSR1)  # the time limit nears for the node still training
    status, out, err = job.finish()
    events = job.events()
    assert f"job step exited with status {STOPPED}" in out, "srun: the highest status"
    assert status == 1 and count(events, r"^scontrol requeue") == 0
    assert "node 1 exited with status 1, not stopped by the signal: not requeued" in err


def test_wait_for_keeps_each_status_when_trapped_signals_come_as_children_exit() -> None:
    """bash's ``wait`` can reap a child and jump to a trap before it records the child's status;
    a later ``wait`` for it then blocks until another child changes state, and beside a promoter
    that runs until told to stop, that is for ever (a node's script hung after its drain this way).
    Here children signal the shell with a trapped SIGUSR1 as they exit, in bursts, beside a child
    that runs on: ``wait_for`` must return each one's own status. The ``wait_for`` that called
    ``wait`` on a running child lost a status in 9 of 12 bursts of 150 here, and hung."""
    script = f"""
        source {DEPLOY / "slurm" / "lib.sh"}
        stops=0
        trap 'stops=$((stops + 1))' USR1
        sleep 600 >/dev/null 2>&1 &
        promoter=$!
        for ((burst = 0; burst < 8; burst++)); do
          children=()
          for ((i = 0; i < 150; i++)); do
            bash -c 'kill -USR1 "$PPID"; exit "$1"' child $((i % 100)) &
            children+=($!)
          done
          for ((i = 0; i < 150; i++)); do
            wait_for "${{children[i]}}"
            got=$?
            [ "${{got}}" = $((i % 100)) ] || echo "burst ${{burst}} child ${{i}}: status ${{got}}"
          done
        done
        kill "${{promoter}}"
        echo "stops ${{stops}}"
    """
    shell = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = shell.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        out, err = shell.communicate()
        err += "\nwait_for still waited after 60 s, beside a child that runs on"
    lines = out.splitlines()
    assert lines and lines[:-1] == [] and re.fullmatch(r"stops \d+", lines[-1]), out + err
    assert int(lines[-1].split()[1]) > 0, "no signal reached the shell: the race was not tried"


def run_launch_unless(tmp_path: Path, stopped_body: str) -> tuple[int, str]:
    """Runs lib.sh's ``launch_unless`` in a shell of its own session that traps SIGUSR1 as node.sh
    does, with ``stopped`` defined by ``stopped_body``; the command would write ``ran``. Returns
    the launcher's exit status and what the shell printed."""
    ran = tmp_path / "ran"
    script = f"""
        source {DEPLOY / "slurm" / "lib.sh"}
        stopping=0
        trap 'stopping=1' USR1
        stopped() {{ {stopped_body} }}
        launch_unless stopped bash -c 'sleep 0.5; echo ran >{ran}'
        wait_for "${{LAUNCHED}}"
        echo "launcher $? stopping=${{stopping}}"
    """
    result = subprocess.run(
        ["bash", "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    handshakes = list(tmp_path.glob("launch.*"))
    assert not handshakes, f"the launch left its handshake behind: {handshakes}"
    return (1 if ran.exists() else 0), result.stdout


def test_a_stop_that_comes_just_after_the_launch_check_still_stops_the_launch(tmp_path: Path) -> None:
    """The check answers "not stopped", then the stop reaches the step's processes at once (a
    signal to the whole process group, as Slurm sends): the command must not run deaf to it. A
    plain ``stopped || cmd &`` would start it after the signal had passed."""
    ran, out = run_launch_unless(tmp_path, 'local was=${stopping}; kill -USR1 0; [ "${was}" = 1 ];')
    assert (ran, out.split()) == (0, ["launcher", "75", "stopping=1"])


def test_launch_unless_runs_the_command_when_no_stop_came_and_not_when_one_did(tmp_path: Path) -> None:
    assert run_launch_unless(tmp_path, "false;") == (1, "launcher 0 stopping=0\n")
    (tmp_path / "ran").unlink()
    assert run_launch_unless(tmp_path, "true;") == (0, "launcher 75 stopping=0\n")


def test_a_torchrun_that_missed_the_stop_gets_it_once_past_its_shutdown_timeout(
    launch: Callable[..., Job],
) -> None:
    """A torchrun started in the instant the stop came never saw it; node.sh sends it the stop
    once torchrun outlives its --shutdown-timeout (+ STOP_GRACE) after it, and only once."""
    job = launch(FAKE_TORCHRUN_MISSES_STOP="1", SAVE_TIMEOUT="1", STOP_GRACE="1")
    job.training()
    job.process.send_signal(signal.SIGUSR1)
    status, out, err = job.finish()
    events = job.events()
    for node in range(NODES):
        assert at(events, rf"^torchrun node={node} missed USR1$") < at(
            events, rf"^torchrun node={node} got USR1$"
        )
    assert_saved_drained_stopped(events, "USR1")
    assert status == 0 and "requeueing 42" in out
    assert len(re.findall(r"missed it; sending it SIGUSR1", err)) == NODES, err


def test_launch_unless_without_a_temporary_directory_still_starts_and_says_what_is_lost(
    tmp_path: Path,
) -> None:
    ran = tmp_path / "ran"
    script = f"""
        source {DEPLOY / "slurm" / "lib.sh"}
        stopped() {{ false; }}
        launch_unless stopped bash -c 'echo ran >{ran}'
        wait_for "${{LAUNCHED}}"
        echo "launcher $?"
    """
    result = subprocess.run(
        ["bash", "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "TMPDIR": str(tmp_path / "absent")},
    )
    assert (result.returncode, result.stdout, ran.exists()) == (0, "launcher 0\n", True)
    assert f"no handshake directory in {tmp_path / 'absent'}" in result.stderr
