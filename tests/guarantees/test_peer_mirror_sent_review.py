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

from tests.forked import in_forked_child
from tests.guarantees.test_peer_mirror_mapped import mapped_inodes
from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers, shard_state
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore.config import Config

_SIZE = 16 * 2**20  # floats: a 64 MiB shard, four messages


def _own_inodes(root: Path, node: int, checkpoint_id: str) -> dict[int, str]:
    return {
        p.stat().st_ino: str(p)
        for p in memory_root(root, node).rglob("*")
        if p.is_file() and checkpoint_id in p.parts and ".tierstore" not in p.parts
    }


def _open_inodes() -> set[int]:
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            continue  # the listing's own descriptor
    return inodes


def _fork_while_sending(rank: int, world: int, root: Path) -> None:
    become(rank)
    writer = TieredWriter(mirror_config(root, lower=()), node=rank)
    dcp.save(shard_state(rank, 1, _SIZE), storage_writer=writer, checkpoint_id="step_1")
    own = _own_inodes(root, rank, "step_1")
    deadline = time.monotonic() + 30
    while not own.keys() & mapped_inodes():  # the round maps the files it sends
        assert time.monotonic() < deadline, f"rank {rank}: never saw a sent file mapped"
        time.sleep(0.0005)
    status = in_forked_child(lambda: 3 if own.keys() & (mapped_inodes() | _open_inodes()) else 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"rank {rank}: a child forked during the round holds a sent file (status {status})"
    )
    assert writer.wait_mirrored(60), f"rank {rank}: not mirrored after the fork"
    writer.close()


def test_a_child_forked_while_a_round_sends_holds_none_of_the_sent_files(shm: Path) -> None:
    """A DataLoader worker forked while the mirror sends the node's files inherits neither their
    mappings nor a descriptor (it would hold their tmpfs pages after retention removes them), and
    the round goes on to mirror them."""
    run_ranks(_fork_while_sending, 2, shm, shm)
    for node in (0, 1):
        assert len(mirror_markers(shm, node, "step_1")) == 1, f"node {node} holds no mirror"


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
    own = _own_inodes(root, 0, "step_1")
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
