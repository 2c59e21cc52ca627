"""deploy/slurm/train.sbatch: promoters per node, torchrun, the pre-emption signal's path, requeue."""

from __future__ import annotations

import re
import subprocess

from tests.deploy import shell
from tests.deploy.contract import (
    ALL_INTERFACES,
    check_batch_fits,
    check_torchrun_args,
    check_trainer_args,
    config,
    parse_tierstore,
)
from tests.deploy.tools import DEPLOY, pip_tool

SBATCH = DEPLOY / "slurm" / "train.sbatch"
SLURM_ENV = {
    "SLURM_SUBMIT_DIR": "/submit", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "5",
    "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "42",
}  # fmt: skip
"""What Slurm sets; SLURM_NODEID 5 to see that each node passes its own index."""


def script() -> str:
    return SBATCH.read_text()


def argvs() -> list[list[str]]:
    return shell.commands(script(), shell.assignments(script(), SLURM_ENV))


def directives() -> dict[str, str]:
    found = re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", script(), re.MULTILINE)
    return {name: value for name, value in found}


def test_shellcheck_finds_nothing() -> None:
    result = subprocess.run(
        [pip_tool("shellcheck"), str(SBATCH)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout


def test_every_tierstore_call_parses_and_uses_this_nodes_index() -> None:
    calls = [parse_tierstore(args) for args in shell.invocations(argvs(), "tierstore")]
    assert [(c.command, c.once) for c in calls] == [("promote", False), ("promote", True)]
    for call in calls:
        assert call.node == 5, (
            "--node must expand on each node (SLURM_NODEID), not in the batch shell"
        )
        assert call.config == "/submit/deploy/tierstore.yaml"
    assert calls[0].metrics_addr == ALL_INTERFACES, "Prometheus scrapes from another host"
    assert calls[0].metrics_port is not None
    promoter_srun = next(a for a in argvs() if a[0] == "srun" and "promote --metrics" in a[-1])
    assert "--ntasks-per-node=1" in promoter_srun and "--overlap" in promoter_srun


def test_torchrun_runs_the_trainer_on_the_nodes_own_rank() -> None:
    (torchrun,) = shell.invocations(argvs(), "torchrun")
    parsed, trainer_args = check_torchrun_args(torchrun)
    assert parsed.node_rank == 5 and parsed.nnodes == "2"
    check_trainer_args(trainer_args, "/submit/deploy/tierstore.yaml")
    check_batch_fits(trainer_args, int(directives()["nodes"]) * int(parsed.nproc_per_node))


def test_the_preemption_signal_reaches_the_workers_and_leaves_time_to_drain() -> None:
    found = directives()
    assert "requeue" in found
    match = re.fullmatch(r"B:USR1@(\d+)", found["signal"])
    assert match, "SIGUSR1 to the batch shell, which forwards it once"
    (torchrun,) = shell.invocations(argvs(), "torchrun")
    parsed, _ = check_torchrun_args(torchrun)
    # torchrun's default would let SIGUSR1 kill it; told to handle it, it forwards it to the workers.
    assert "SIGUSR1" in parsed.signals_to_handle.split(",")
    lead = int(match.group(1))
    assert parsed.shutdown_timeout + config().promote.grace_period < lead
    text = script()
    assert re.search(r"^trap on_usr1 USR1$", text, re.MULTILINE)
    assert 'kill -USR1 "${trainer}"' in text
    order = [text.index(s) for s in ("trap on_usr1 USR1", "promote --once'", 'scontrol requeue "')]
    assert order == sorted(order), "signal, then drain, then requeue"
