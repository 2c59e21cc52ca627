"""The 2-rank trainer of ``test_kill_points.py``: saves ``step_FIRST .. step_LAST``, then exits.

``python kill_child.py CONFIG FIRST LAST MODE STORE``: two ranks (forked by torch.multiprocessing,
gloo on loopback, rendezvous through the file ``STORE``) save each step through ``TieredWriter``,
``dcp.save`` (MODE ``sync``) or ``dcp.async_save`` in THREAD mode, waited on (``async``). Rank 0
prints ``committed step_N`` after each save returns. The parent arms a kill point through
``TIERSTORE_KILL_POINT`` (inherited by both ranks) or kills the process group at a random time;
a rank killed makes torch.multiprocessing end the other one and this process exit 1.

``python kill_child.py batch JOBS``: the same trainer for each job of the JSON file ``JOBS``
(``[config, first, last, mode, store, kill point spec, log file]``), one after the other, each in a
process forked from this one, which imported torch but not tierstore: each job's process imports
tierstore itself, so it reads its own ``TIERSTORE_KILL_POINT`` at import like any new process (as
the tests' forkserver preloads torch, to spare every job the seconds of importing it). Its stdout
and stderr go to the log file; one JSON line per job here: the job's wait status.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

WORLD = 2
KILL_VARIABLE = "TIERSTORE_KILL_POINT"  # tierstore._platform.killpoints.VARIABLE, not imported before a fork


def rank_state(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: two tensors (so a data file is written in two pieces)
    and a byte item; deterministic, so the parent rebuilds it to check a restore bit-exact."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"w{rank}": torch.randn(1 << 17, generator=generator),
        f"c{rank}": torch.randint(0, 1 << 40, (1 << 14,), generator=generator, dtype=torch.int64),
        f"blob{rank}": bytes([step % 256, rank]) * 2048,
    }


def job_state(step: int) -> dict[str, Any]:
    """Every rank's state at ``step``: what a restore in one process loads."""
    state: dict[str, Any] = {}
    for rank in range(WORLD):
        state.update(rank_state(rank, step))
    return state


def _rank(rank: int, job: tuple[str, int, int, str, str]) -> None:
    from tierstore import TieredWriter, load_config

    config_path, first, last, mode, store = job

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    config = load_config(config_path)
    for step in range(first, last + 1):
        writer = TieredWriter(config)
        state, checkpoint_id = rank_state(rank, step), f"step_{step}"
        if mode == "sync":
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
        else:
            saving = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
            assert isinstance(saving, Future)  # no async_stager given: a plain future
            saving.result()
        if rank == 0:
            print(f"committed {checkpoint_id}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def train(config: str, first: str, last: str, mode: str, store: str) -> None:
    """Run the two ranks (forked from this process) to the end; raise if one failed or died."""
    import tierstore._platform.killpoints  # noqa: F401 - this process reads the kill point now, the ranks inherit it

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    job = (config, int(first), int(last), mode, store)
    mp.start_processes(_rank, args=(job,), nprocs=WORLD, join=True, start_method="fork")


def _job(job: list[str]) -> int:
    *args, spec, log = job
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.pop(KILL_VARIABLE, None)
    if spec:
        os.environ[KILL_VARIABLE] = spec
    try:
        train(*args)
    except BaseException:  # noqa: BLE001 - the log says what; the status says it failed
        traceback.print_exc()
        return 1
    return 0


def batch(jobs_file: str) -> None:
    assert "tierstore" not in sys.modules, "each job must import tierstore itself"
    with open(jobs_file) as f:
        jobs: list[list[str]] = json.load(f)
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _job(job)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"log": job[-1], "status": status}), flush=True)


def main() -> None:
    if sys.argv[1] == "batch":
        batch(sys.argv[2])
    else:
        train(*sys.argv[1:6])


if __name__ == "__main__":
    main()
