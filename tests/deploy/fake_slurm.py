"""Fake ``srun``, ``scontrol``, ``scancel``, ``torchrun`` and ``tierstore`` executables, and a runner
that starts deploy/slurm/train.sbatch under them: the script's own logic, with real processes and
real signals.

The fakes behave as Slurm does where it matters to the script (read in Slurm's source): ``srun``
runs one task per node, each in a process group of its own, and forwards a signal to *every
process* of its tasks (slurmstepd signals the whole step), except SIGTERM, which it turns into
SIGKILL ("forcing job termination"); ``scancel --signal=SIG JOB.STEP`` signals the step's processes.
Every fake appends what it does to one event log, one line at a time, so a test reads the order.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.tools import DEPLOY

SRUN = """#!{python}
import os, signal, subprocess, sys
log = open(os.environ["EVENTS"], "a", buffering=1)
args = sys.argv[1:]
log.write("srun " + " ".join(args) + "\\n")
while args and args[0].startswith("-"):
    args.pop(0)
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
tasks = [
    subprocess.Popen(args, start_new_session=True,
                     env={**os.environ, "SLURM_NODEID": str(n), "SLURM_STEP_ID": "0"})
    for n in range(nodes)
]
with open(os.environ["STEP_PIDS"], "w") as out:
    out.write(" ".join(str(t.pid) for t in tasks))

def forward(signum, _frame):
    sent = signal.SIGKILL if signum == signal.SIGTERM else signum
    log.write(f"srun got {signal.Signals(signum).name}, sends {signal.Signals(sent).name}\\n")
    for task in tasks:
        try:
            os.killpg(task.pid, sent)
        except ProcessLookupError:
            pass

for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(signum, forward)
codes = [task.wait() for task in tasks]
sys.exit(max(code if code >= 0 else 128 - code for code in codes))
"""

SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"${EVENTS}"
case "$1" in
  show) echo localhost ;;
  requeue) exit "${FAKE_REQUEUE_STATUS:-0}" ;;
esac
"""

SCANCEL = """#!/bin/bash
echo "scancel $*" >>"${EVENTS}"
for pid in $(cat "${STEP_PIDS}"); do
  kill -"${1#--signal=}" -- "-${pid}" 2>/dev/null
done
exit 0
"""

TORCHRUN = """#!/bin/bash
node=${SLURM_NODEID}
echo "torchrun node=${node} start $*" >>"${EVENTS}"
signalled=0
missed=${FAKE_TORCHRUN_MISSES_STOP:-0}  # 1: deaf to the first SIGUSR1, as one started as it came
got_usr1() {
  if [ "${missed}" = 1 ]; then
    missed=0
    echo "torchrun node=${node} missed USR1" >>"${EVENTS}"
    return
  fi
  echo "torchrun node=${node} got USR1" >>"${EVENTS}"
  signalled=1
}
trap got_usr1 USR1
trap 'echo "torchrun node=${node} got TERM" >>"${EVENTS}"; signalled=1' TERM
tenths=${FAKE_TRAIN_TENTHS:-600}
[ "${FAKE_CRASH_NODE:-}" = "${node}" ] && tenths=5  # this node's training crashes after 0.5 s
for ((i = 0; i < tenths; i++)); do
  [ "${signalled}" = 1 ] && break
  : "$(sleep 0.1)"  # not a plain sleep: bash reports one killed by the step's signal in the job's stderr
done
code=0
[ "${FAKE_CRASH_NODE:-}" = "${node}" ] && [ "${signalled}" = 0 ] && code=1
if [ "${signalled}" = 1 ]; then
  sleep 1  # the final save
  code=1   # torchrun's status after a handled signal
fi
echo "torchrun node=${node} exit ${code}" >>"${EVENTS}"
exit "${code}"
"""

TIERSTORE = """#!{python}
import os, signal, socket, sys, time
args = sys.argv[1:]
node = args[args.index("--node") + 1]
log = open(os.environ["EVENTS"], "a", buffering=1)
if "--once" in args:
    log.write(f"drain node={node} start\\n")
    if os.environ.get("FAKE_DRAIN_HANGS"):  # a hung mount: deaf to SIGTERM, only SIGKILL ends it
        signal.signal(signal.SIGTERM, lambda *_: log.write(f"drain node={node} got TERM\\n"))
        while True:
            time.sleep(0.1)
    time.sleep(0.3)
    log.write(f"drain node={node} exit 0\\n")
    sys.exit(0)
port = int(args[args.index("--metrics-port") + 1])
log.write(f"promoter node={node} start port={port}\\n")
if os.environ.get("FAKE_PROMOTER_FAILS_ON") == node:
    print(f"tierstore: error: --metrics-port {port}: cannot listen on 0.0.0.0:{port}: Address"
          " already in use (choose a free port with --metrics-port, or 0 for any free port)",
          file=sys.stderr)
    log.write(f"promoter node={node} exit 2\\n")
    sys.exit(2)
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # both fake nodes share one host
listener.bind(("127.0.0.1", port))
listener.listen()
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(log.write(f"promoter node={node} got TERM\\n")))
dies = os.environ.get("FAKE_PROMOTER_DIES_ONCE")
if dies and not os.path.exists(dies):
    open(dies, "w").close()
    while f"torchrun node={node} start" not in open(os.environ["EVENTS"]).read():
        time.sleep(0.05)
    log.write(f"promoter node={node} exit 1\\n")
    sys.exit(1)
while not stopping:
    time.sleep(0.05)
while os.environ.get("FAKE_PROMOTER_HANGS"):  # stuck in a hung mount: only SIGKILL ends it
    time.sleep(0.1)
time.sleep(0.2)  # the files in flight
log.write(f"promoter node={node} exit 0\\n")
"""

FAKES = {"srun": SRUN, "scontrol": SCONTROL, "scancel": SCANCEL, "torchrun": TORCHRUN, "tierstore": TIERSTORE}
NODES = 2


@dataclass
class Job:
    """A running train.sbatch under the fakes."""

    process: subprocess.Popen[str]
    events_file: Path
    step_pids_file: Path

    def events(self) -> list[str]:
        return self.events_file.read_text().splitlines() if self.events_file.exists() else []

    def wait_for_event(self, pattern: str, count: int = 1, timeout: float = 30.0) -> None:
        """Until ``count`` events match ``pattern`` (a regex), or fail naming what happened."""
        deadline = time.monotonic() + timeout
        while len([e for e in self.events() if re.search(pattern, e)]) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                out, err = self.process.communicate(timeout=30)
                raise AssertionError(f"no {pattern!r} x{count}: {self.events()}\n{out}\n{err}")
            time.sleep(0.05)

    def training(self) -> None:
        """Until torchrun runs on every node."""
        self.wait_for_event(r"^torchrun node=\d start", NODES)

    def signal_step(self, signum: signal.Signals) -> None:
        """Signal every process of the training step, as slurmstepd does on a pre-emption."""
        for pid in self.step_pids_file.read_text().split():
            os.killpg(int(pid), signum)

    def kill(self) -> None:
        """SIGKILL whatever of this job still runs, so a failed test leaves nothing behind."""
        self._kill_all()
        self.process.communicate()

    def _kill_all(self) -> None:
        """SIGKILL the job's process groups: the batch shell's and each task's."""
        pids = self.step_pids_file.read_text().split() if self.step_pids_file.exists() else []
        for pgid in [self.process.pid, *map(int, pids)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)

    def finish(self, timeout: float = 60.0) -> tuple[int, str, str]:
        """The batch script's exit status, stdout and stderr. A job still running after
        ``timeout`` is killed and the test fails with its events and its whole stderr: a hang seen
        once in a full run must say where each node was. A minute: a job takes 7 to 12 s alone and
        took 45 s beside three busy processes on two cores; the jobs that outlived a minute before
        were hung, not slow (lib.sh's ``wait_for`` lost a child's status)."""
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_all()
            out, err = self.process.communicate()
            events = "\n".join(self.events())
            raise AssertionError(
                f"the job still ran after {timeout:g} s\nevents:\n{events}\nstdout:\n{out}\nstderr:\n{err}"
            ) from None
        return self.process.returncode, out, err


def start(tmp: Path, job_id: int = 42, **env: str) -> Job:
    """Write the fakes and start ``bash train.sbatch`` as Slurm would, in its own session."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKES.items():
        fake = bin_dir / name
        fake.write_text(text.replace("{python}", sys.executable))
        fake.chmod(0o755)
    (tmp / "sd").mkdir(exist_ok=True)
    variables = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(tmp),
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NUM_NODES": str(NODES),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_PER_TASK": "4",
        "DEPLOY_DIR": str(DEPLOY / "slurm"),
        "METRICS_SD_DIR": str(tmp / "sd"),
        "EVENTS": str(tmp / "events"),
        "STEP_PIDS": str(tmp / "step-pids"),
        "PROMOTER_RESTART_DELAY": "0",
        **env,
    }
    process = subprocess.Popen(
        ["bash", str(DEPLOY / "slurm" / "train.sbatch")],
        env=variables,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return Job(process, tmp / "events", tmp / "step-pids")
