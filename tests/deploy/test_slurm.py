"""deploy/slurm: train.sbatch (resources, ports, the stop signal, requeue) and node.sh (one node's
promoter, torchrun and drain), read statically. tests/deploy/test_slurm_signals.py runs them."""

from __future__ import annotations

import re
import shlex

from tests.deploy import shell
from tests.deploy.contract import (
    ALL_INTERFACES,
    check_batch_fits,
    check_torchrun_args,
    check_trainer_args,
    config,
    parse_tierstore,
)
from tests.deploy.tools import DEPLOY, assert_shellcheck_clean

SLURM = DEPLOY / "slurm"
SBATCH = SLURM / "train.sbatch"
NODE_SH = SLURM / "node.sh"
SLURM_ENV = {
    "SLURM_SUBMIT_DIR": "/submit",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "5",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_ID": "42",
    "SLURM_CPUS_PER_TASK": "64",
}
"""What Slurm sets; SLURM_NODEID 5 to see that each node passes its own index."""
RUN_TIME = {"port": "30042", "MASTER_PORT": "20042"}
"""The ports the scripts find free at run time, as these tests stand them in."""


def script() -> str:
    return SBATCH.read_text()


def batch_env() -> dict[str, str]:
    return shell.assignments(script(), SLURM_ENV)


def argvs() -> list[list[str]]:
    return shell.commands(script(), batch_env())


def node_srun() -> list[str]:
    (srun,) = [a for a in argvs() if a[0] == "srun"]
    return srun


def node_calls(program: str) -> list[list[str]]:
    """The arguments of every call of ``program`` in node.sh, as srun starts it on node 5 (its
    ``"$@"`` is what train.sbatch passes)."""
    srun = node_srun()
    args = srun[srun.index(str(NODE_SH).replace(str(DEPLOY.parent), "/submit")) + 1 :]
    text = NODE_SH.read_text().replace('"$@"', shlex.join(args))
    lines = [line for line in shell.logical_lines(text) if re.search(rf"\b{program} --", line)]
    env = {**shell.assignments(text, batch_env()), **RUN_TIME}
    return shell.invocations(shell.commands("\n".join(lines), env), program)


def directives() -> dict[str, str]:
    found = re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", script(), re.MULTILINE)
    return {name: value for name, value in found}


def test_shellcheck_finds_nothing() -> None:
    for path in (SBATCH, NODE_SH, SLURM / "lib.sh"):
        assert_shellcheck_clean(path)


def test_every_tierstore_call_parses_and_uses_this_nodes_index() -> None:
    calls = [parse_tierstore(args) for args in node_calls("tierstore")]
    assert [(c.command, c.once) for c in calls] == [("promote", False), ("promote", True)]
    for call in calls:
        assert call.node == 5, "--node must be this node's SLURM_NODEID"
        assert call.config == "/submit/deploy/tierstore.yaml"
    assert calls[0].metrics_addr == ALL_INTERFACES, "Prometheus scrapes from another host"
    assert calls[0].metrics_port == int(RUN_TIME["port"])


def test_torchrun_runs_the_trainer_on_the_nodes_own_rank() -> None:
    (torchrun,) = node_calls("torchrun")
    parsed, trainer_args = check_torchrun_args(torchrun)
    assert parsed.node_rank == 5 and parsed.nnodes == "2"
    check_trainer_args(trainer_args, "/submit/deploy/tierstore.yaml")
    check_batch_fits(trainer_args, int(directives()["nodes"]) * int(parsed.nproc_per_node))


def test_one_task_per_node_with_its_cpus_and_no_kill_on_a_nodes_stop_status() -> None:
    found, srun = directives(), node_srun()
    # The memory tier's tmpfs pages are charged to the job: whole nodes, all their memory.
    assert "exclusive" in found and found["mem"] == "0"
    assert int(found["cpus-per-task"]) > 1 and found["ntasks-per-node"] == "1"
    # srun does not inherit --cpus-per-task from sbatch (Slurm 22.05 and later).
    assert "--cpus-per-task=64" in srun and "--ntasks-per-node=1" in srun
    # A node that stops first exits 75: the others must not be killed in their save or drain.
    assert "--kill-on-bad-exit=0" in srun


def test_ports_come_from_the_job_id() -> None:
    text = script()
    assert re.search(
        r"^MASTER_PORT=\$\(free_port \$\(\(\d+ \+ SLURM_JOB_ID % \d+\)\)\) \|\| exit 1$", text, re.M
    )
    assert re.search(r"^METRICS_PORT=\$\(\(\d+ \+ SLURM_JOB_ID % \d+\)\)$", text, re.M)
    assert re.search(r'^port=\$\(free_port "\$\{METRICS_PORT\}"\) \|\| ', NODE_SH.read_text(), re.M)


def test_the_stop_fits_in_the_signals_lead_time() -> None:
    found = directives()
    assert "requeue" in found
    match = re.fullmatch(r"B:USR1@(\d+)", found["signal"])
    assert match, "SIGUSR1 to the batch shell, which forwards it once"
    (torchrun,) = node_calls("torchrun")
    parsed, _ = check_torchrun_args(torchrun)
    # torchrun's default would let SIGUSR1 kill it; told to handle it, it forwards it to the workers.
    assert {"SIGUSR1", "SIGTERM"} <= set(parsed.signals_to_handle.split(","))
    env = batch_env()
    save, drain = int(env["SAVE_TIMEOUT"]), int(env["DRAIN_TIMEOUT"])
    assert parsed.shutdown_timeout == save
    (drain_line,) = [x for x in shell.logical_lines(NODE_SH.read_text()) if "promote --once" in x]
    bounded = r'timeout --kill-after="\$\{STOP_GRACE\}" "\$\{DRAIN_TIMEOUT\}"\s+tierstore '
    assert re.search(bounded, drain_line), "a bounded drain, killed if it outlives its grace"
    stop_grace = int(shell.assignments(NODE_SH.read_text(), batch_env())["STOP_GRACE"])
    grace = config().promote.grace_period
    assert stop_grace > grace, "SIGKILL only after the files in flight had promote.grace_period"
    # The save, the drain, then its files in flight and the promoter's stop, each at most
    # STOP_GRACE before SIGKILL.
    assert save + drain + 2 * stop_grace < int(match.group(1))


def test_the_batch_shell_forwards_sigusr1_for_both_signals_and_requeues_on_75() -> None:
    text = script()
    assert re.search(r"^trap 'ask_stop .*' USR1$", text, re.MULTILINE)
    assert re.search(r"^trap 'ask_stop .*' TERM$", text, re.MULTILINE)
    assert 'kill -USR1 "${step}"' in text and "kill -TERM" not in text, "srun: SIGTERM = SIGKILL"
    assert re.search(r'if \[ "\$\{status\}" = 75 \]; then\n(.*\n){1,4}\s+scontrol requeue', text)
