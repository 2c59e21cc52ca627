"""Review of the sent files' mappings (ed9c404): a sent file is mapped through libc, private, never
inherited, and let go of after the round's end, on every way a round ends."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tests.guarantees.test_peer_mirror_mapped import mapped_inodes
from tests.mirror_jobs import become, memory_root, mirror_config, shard_state
from tierstore import TieredWriter
from tierstore.config import Config

_SIZE = 16 * 2**20  # floats: a 64 MiB shard, four messages


def _die_once_receiving(root: Path) -> None:
    """Kill this process as soon as a file of step_1 lands in its node's mirror (its peer is then
    sending)."""
    where = memory_root(root, 1) / ".tierstore" / "mirror" / "step_1"
    while True:
        if any(p.name.startswith(".") for p in where.glob("*/*")):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)


def _killed_peer_job(rank: int, world: int, store: str, config: Config, root: Path) -> None:
    from tests.workers import init_group

    init_group(rank, world, store)
    become(rank)
    if rank == 1:
        threading.Thread(target=_die_once_receiving, args=(root,), daemon=True).start()
    else:
        # A large trainer runs the full collection rarely: only what the round itself lets go of
        # is let go of in time. Garbage collection is left to the round, as there.
        gc.disable()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tierstore").addHandler(handler)
    writer = TieredWriter(config, node=rank)
    try:
        dcp.save(shard_state(rank, 1, _SIZE), storage_writer=writer, checkpoint_id="step_1")
    except BaseException as exc:  # noqa: BLE001 - the peer may die before DCP's last broadcast
        said.append(f"save: {exc}")
    writer.wait_mirrored(60)
    own = {
        p.stat().st_ino: str(p)
        for p in memory_root(root, 0).rglob("*")
        if p.is_file() and "step_1" in p.parts and ".tierstore" not in p.parts
    }
    deadline = time.monotonic() + 2
    while (still := own.keys() & mapped_inodes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    result = {"still": [own[i] for i in still], "own": list(own.values()), "said": said}
    (root / "result0.json").write_text(json.dumps(result))
    time.sleep(600)


def test_a_round_whose_sending_failed_lets_go_of_the_sent_files(tmp_path: Path, shm: Path) -> None:
    """A peer killed while this rank sends: the send fails, the round ends (reduced redundancy),
    and the files it was sending are unmapped after the round, as after one that succeeded (not
    at some later garbage collection: a removed file's tmpfs pages would stay held till then)."""
    config = mirror_config(shm, lower=(), timeout="2s")
    store = str(tmp_path / "store")
    context = mp.get_context("forkserver")
    ranks = [context.Process(target=_killed_peer_job, args=(r, 2, store, config, shm))
             for r in (0, 1)]  # fmt: skip
    for process in ranks:
        process.start()
    result_file = shm / "result0.json"
    try:
        deadline = time.monotonic() + 60
        while not result_file.exists():
            assert time.monotonic() < deadline, "rank 0 never ended its round"
            assert ranks[0].exitcode is None, "rank 0 died"
            time.sleep(0.05)
        time.sleep(0.1)
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert ranks[1].exitcode == -signal.SIGKILL
    result = json.loads(result_file.read_text())
    assert result["own"], "rank 0 saved no files"
    assert any("sending" in line for line in result["said"]), (
        f"the peer died after rank 0's sends were out (not the case under test): {result['said']}"
    )
    assert not result["still"], f"rank 0 still maps the files it sent: {result['still']}"
