"""Review of the sent files' mappings (ed9c404): a sent file is mapped through libc, private, never
inherited, and let go of after the round's end, on every way a round ends."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tests.forked import in_forked_child
from tests.mirror_jobs import become, memory_root, mirror_config, mirror_markers, shard_state
from tests.process_files import mapped_inodes, open_inodes, own_checkpoint_files
from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore._platform.mapping import populate_for_reading
from tierstore.config import Config
from tierstore.dcp.mirror.spares import Spares
from tierstore.dcp.mirror.transport import map_file
from tierstore.tiers.memory import MemoryTier

_SIZE = 16 * 2**20  # floats: a 64 MiB shard, four messages


def _fork_while_sending(rank: int, world: int, root: Path) -> None:
    become(rank)
    writer = TieredWriter(mirror_config(root, lower=()), node=rank)
    dcp.save(shard_state(rank, 1, _SIZE), storage_writer=writer, checkpoint_id="step_1")
    own = own_checkpoint_files(root, rank, "step_1")
    deadline = time.monotonic() + 30
    while not own.keys() & mapped_inodes():  # the round maps the files it sends
        assert time.monotonic() < deadline, f"rank {rank}: never saw a sent file mapped"
        time.sleep(0.0005)
    # The mappings only: a descriptor open for the moment a file is being mapped is the next
    # test's (deterministic there; here it depends on when the fork lands).
    status = in_forked_child(lambda: 3 if own.keys() & mapped_inodes() else 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"rank {rank}: a child forked during the round holds a sent file (status {status})"
    )
    assert writer.wait_mirrored(60), f"rank {rank}: not mirrored after the fork"
    writer.close()


def test_a_child_forked_while_a_round_sends_holds_none_of_the_sent_files(shm: Path) -> None:
    """A DataLoader worker forked while the mirror sends the node's files does not inherit their
    mappings (it would hold their tmpfs pages after retention removes them), and the round goes on
    to mirror them."""
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
    own = own_checkpoint_files(root, 0, "step_1")
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
    killed, result = _until_rank_0_reports(_killed_peer_job, tmp_path, shm)
    assert killed == -signal.SIGKILL
    assert result["own"], "rank 0 saved no files"
    assert any("sending" in line for line in result["said"]), (
        f"the peer died after rank 0's sends were out (not the case under test): {result['said']}"
    )
    assert not result["still"], f"rank 0 still maps the files it sent: {result['still']}"


def _until_rank_0_reports(
    job: Callable[[int, int, str, Config, Path], None], tmp_path: Path, shm: Path
) -> tuple[int | None, dict[str, Any]]:
    """Run ``job`` on two ranks (mirrored memory tiers in ``shm``, a 2 s mirror timeout) until rank 0
    writes its ``result0.json``; kill both. Rank 1's exit code and rank 0's result."""
    config = mirror_config(shm, lower=(), timeout="2s")
    store = str(tmp_path / "store")
    context = mp.get_context("forkserver")
    ranks = [context.Process(target=job, args=(r, 2, store, config, shm)) for r in (0, 1)]
    for process in ranks:
        process.start()
    result_file = shm / "result0.json"
    try:
        deadline = time.monotonic() + 60
        while not result_file.exists():
            assert time.monotonic() < deadline, "rank 0 never ended its round"
            assert ranks[0].exitcode is None, "rank 0 died"
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written whole: let its writer finish
    finally:
        for process in ranks:
            process.kill()
            process.join()
    return ranks[1].exitcode, json.loads(result_file.read_text())


def _deleted_mappings(root: Path) -> list[str]:
    """The files under ``root`` this process still maps after they were removed."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line.split(maxsplit=5)[-1] for line in lines if str(root) in line and "(deleted)" in line]


def _die_once_sending(root: Path) -> None:
    while not own_checkpoint_files(root, 1, "step_2").keys() & mapped_inodes():
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)  # this rank's round is sending: the peer receives


def _killed_in_second_round(rank: int, world: int, store: str, config: Config, root: Path) -> None:
    from tests.workers import init_group

    init_group(rank, world, store)
    become(rank)
    if rank == 0:
        gc.disable()  # as above: only what the round lets go of counts
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1, _SIZE), storage_writer=writer, checkpoint_id="step_1")
    assert writer.wait_mirrored(60)
    if rank == 1:
        threading.Thread(target=_die_once_sending, args=(root,), daemon=True).start()
    else:
        deadline = time.monotonic() + 10  # the refill after step_1 maps a spare of the size
        while "mirror-spare" not in Path("/proc/self/maps").read_text():
            assert time.monotonic() < deadline, "no mapped spare after the first round"
            time.sleep(0.01)
    with contextlib.suppress(BaseException):  # the peer may die before DCP's last broadcast
        dcp.save(shard_state(rank, 2, _SIZE), storage_writer=writer, checkpoint_id="step_2")
    writer.wait_mirrored(60)
    deadline = time.monotonic() + 2
    while (still := _deleted_mappings(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (root / "result0.json").write_text(json.dumps({"still": still}))
    time.sleep(600)


def test_a_round_cut_short_while_receiving_into_a_mapped_spare_lets_go_of_it(
    tmp_path: Path, shm: Path
) -> None:
    """The peer dies in the second round (files land in mapped spares): after the round no removed
    file, sent or received, is still mapped (its tmpfs pages would stay held)."""
    killed, result = _until_rank_0_reports(_killed_in_second_round, tmp_path, shm)
    assert killed == -signal.SIGKILL, "rank 1 was not killed in the second round"
    still = result["still"]
    assert not still, f"rank 0 still maps removed files: {still}"


def test_a_child_forked_while_a_sent_file_is_being_mapped_holds_no_descriptor_of_it(shm: Path) -> None:
    """``map_file`` opens the file, maps it and closes it; the mmap and madvise calls go through
    ctypes, which lets other threads run meanwhile. A trainer thread that forks a DataLoader worker
    then must not hand the child the descriptor, open for that moment (it would keep the file and
    its tmpfs pages for the worker's life, as a kept descriptor would)."""
    tier = MemoryTier("memory", str(shm))
    tier.write_bytes("step_1/g/r0.distcp", os.urandom(2**20))
    inode = os.stat(tier.local_path("step_1/g/r0.distcp")).st_ino
    stop = threading.Event()

    def send_rounds() -> None:  # a mirror thread mapping the file again and again
        while not stop.is_set():
            view = tier.map_file("step_1/g/r0.distcp")
            del view

    sender = threading.Thread(target=send_rounds, daemon=True)
    sender.start()
    statuses = []
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            statuses.append(in_forked_child(lambda: 4 if inode in open_inodes() else 0))
    finally:
        stop.set()
        sender.join()
    assert inode not in open_inodes(), "the file is kept open (not only while being mapped)"
    held = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 4 for s in statuses)
    assert all(os.WIFEXITED(s) for s in statuses), "a forked child did not exit"
    assert not held, f"{held} of {len(statuses)} children forked meanwhile hold the file open"


def test_a_child_forked_while_a_spare_is_being_mapped_holds_no_descriptor_of_it(shm: Path) -> None:
    """The same for the spares: a refill (between rounds) or a take (a back-to-back round maps a
    recycled spare) holds the spare open, read-write, while its page tables fill (MAP_POPULATE: 0.03
    to 0.1 s for 256 MiB, the GIL released); a child forked then must not keep it."""
    tier = MemoryTier("memory", str(shm))
    spares = Spares(tier)
    stop = threading.Event()

    def rounds() -> None:  # a mirror thread: each round takes the spare, the refill makes another
        while not stop.is_set():
            spares.take(4 * 2**20)
            spares.refill()
            spare = spares.take(4 * 2**20)
            assert spare is not None
            mapping = spares.mapping(spare)
            if mapping is not None:
                mapping.close()
            spares.discard(spare)

    def spare_open() -> int:
        names = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                names.append(os.readlink(f"/proc/self/fd/{name}"))
        return 4 if any("mirror-spare" in n for n in names) else 0

    worker = threading.Thread(target=rounds, daemon=True)
    worker.start()
    statuses = []
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            statuses.append(in_forked_child(spare_open))
    finally:
        stop.set()
        worker.join()
    assert spare_open() == 0, "a spare is kept open (not only while it is being mapped)"
    held = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 4 for s in statuses)
    assert all(os.WIFEXITED(s) for s in statuses), "a forked child did not exit"
    assert not held, f"{held} of {len(statuses)} children forked meanwhile hold a spare open"


def test_filling_a_messages_page_tables_is_best_effort_never_a_crash(shm: Path) -> None:
    """``send_files`` fills each message's page tables before posting it: on a mapping of a file
    truncated meanwhile (the pages past its end would be a SIGBUS if touched), on the zeros sent
    for a vanished file, at an odd offset, on memory that is no mapping at all: never an error,
    never a signal (in a forked child, so that a SIGBUS fails the test, not the run)."""
    tier = MemoryTier("memory", str(shm))
    tier.write_bytes("step_1/g/r0.distcp", os.urandom(3 * 2**20 + 5))

    # Made here, not in the child: a torch op that runs on OpenMP's threads in a child forked
    # after the parent used them can hang (GNU OpenMP is not fork-safe).
    zeros = torch.zeros(3 * 2**20 + 5, dtype=torch.uint8)

    def populate_everything() -> int:
        data = map_file(tier, "step_1/g/r0.distcp", 3 * 2**20 + 5)
        os.truncate(tier.local_path("step_1/g/r0.distcp"), 0)
        populate_for_reading(data.data_ptr(), data.numel())
        populate_for_reading(data[4097:].data_ptr(), 2**20)
        populate_for_reading(zeros[5:].data_ptr(), 2**20)
        populate_for_reading(0, 4096)
        return 5 if zeros.numpy().any() else 0

    status = in_forked_child(populate_everything, deadline=30)
    assert os.WIFEXITED(status), f"filling page tables killed the process (signal {status & 0x7F})"
    assert os.WEXITSTATUS(status) == 0, f"filling page tables raised (status {status})"
