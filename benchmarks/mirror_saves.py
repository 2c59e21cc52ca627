"""The saving side of the peer-mirror benchmark: exchange throughput and the trainer's stall.

Runs on every rank (see :mod:`benchmarks.mirror_rank`); every figure is the slowest rank's, or the
span from the last rank's start to the last rank's end.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from benchmarks.mirror_rank import Rank, check_mirrored, gather, retire, wait_mirrored
from benchmarks.workload import state_bytes
from tierstore import TieredWriter


def measure_throughput(r: Rank, writer: TieredWriter) -> None:
    """Rounds of: a synchronous save into the mirrored tier, timed to ``wait_mirrored``; plain gloo
    ``isend``/``irecv`` of the same bytes in both directions, the best of :data:`PLAIN_CHUNKS`; the
    order alternates from round to round."""
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    for index in range(r.job.reps + 1):  # round 0 allocates and warms up: not counted
        plain = plain_cpu = 0.0
        if index % 2 and buffers is not None:
            plain, plain_cpu = best_plain_exchange(*buffers)
        checkpoint_id = r.next_id()
        dist.barrier()
        started = time.monotonic()
        dcp.save(r.state, storage_writer=writer, checkpoint_id=checkpoint_id)
        saved = time.monotonic() - started
        cpu_before = process_cpu()
        waited = wait_mirrored(r, writer, checkpoint_id)
        exchange_cpu = sum(gather(process_cpu() - cpu_before))
        timing = check_mirrored(r, writer, checkpoint_id)
        retire(writer, keep=checkpoint_id)
        sizes = gather(timing.nbytes)
        if buffers is None:
            buffers = (fill(sizes[r.rank]), torch.empty(sizes[1 - r.rank], dtype=torch.uint8))
            buffers[1].fill_(0)
        if not index % 2:
            plain, plain_cpu = best_plain_exchange(*buffers)
        whole = r.span(timing.started, timing.ended)
        assert timing.transfer is not None
        transfer = r.span(*timing.transfer)
        if not index:
            continue
        moved = sum(sizes)
        r.sample("mirror exchange, whole round (both nodes' files)", whole, moved)
        r.sample("mirror exchange, file-transfer step only", transfer, moved)
        r.sample("plain gloo isend/irecv, same bytes, both directions (best chunk size)", plain, moved)
        r.sample("sync save into the mirrored memory tier", r.slowest(saved), r.total_bytes)
        r.sample("wait_mirrored after the sync save returned", r.slowest(waited), moved)
        r.pair("mirror exchange / plain gloo send+recv (bandwidth)", plain / whole)
        r.pair("mirror file transfer / plain gloo send+recv (bandwidth)", plain / transfer)
        r.pair(CPU_RATIO, exchange_cpu / plain_cpu)
        r.extra.setdefault(CPU_SECONDS, []).append(
            {
                "mirror exchange": round(exchange_cpu, 4),
                "plain gloo": round(plain_cpu, 4),
                "bytes moved": moved,
            }
        )
    r.say("throughput done")


CPU_RATIO = "mirror exchange CPU / plain gloo CPU (both ranks, all threads)"
CPU_SECONDS = "CPU seconds per round (both ranks, all threads)"
"""On two cores CPU is the bound, and CPU counts are less noisy than wall time. The mirror's
count starts when ``dcp.save`` returns (the round's first collective, before, is small) and ends
at ``wait_mirrored`` (the spares reserved after the round are between rounds: not counted)."""


def process_cpu() -> float:
    """CPU seconds this process has used so far, all threads (gloo's own included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fill(nbytes: int) -> torch.Tensor:
    """``nbytes`` of random bytes (touched: no page faults inside the timed part)."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8)


PLAIN_CHUNKS = (2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20)
"""Message sizes of the plain gloo baseline; each round counts its fastest."""


def best_plain_exchange(send: torch.Tensor, receive: torch.Tensor) -> tuple[float, float]:
    """The fastest :func:`plain_exchange` of :data:`PLAIN_CHUNKS` (the same on both ranks), and
    the CPU seconds it took (both ranks, all threads)."""
    best = (float("inf"), 0.0)
    for chunk in PLAIN_CHUNKS:
        before = process_cpu()
        seconds = plain_exchange(send, receive, chunk)
        best = min(best, (seconds, sum(gather(process_cpu() - before))))
    return best


def plain_exchange(send: torch.Tensor, receive: torch.Tensor, chunk: int) -> float:
    """Both ranks send their buffer to the other and receive the other's: plain torch.distributed,
    the default gloo group, one message per ``chunk`` bytes. Seconds, as :meth:`Rank.span`
    measures."""
    peer = 1 - dist.get_rank()
    dist.barrier()
    started = time.monotonic()
    works = [
        dist.isend(send[s : s + chunk], dst=peer, tag=i) for i, s in enumerate(range(0, send.numel(), chunk))
    ]
    works += [
        dist.irecv(receive[s : s + chunk], src=peer, tag=i)
        for i, s in enumerate(range(0, receive.numel(), chunk))
    ]
    for work in works:
        assert work is not None
        work.wait()
    ended = time.monotonic()
    both = gather((started, ended))
    return max(e for _, e in both) - max(s for s, _ in both)


@dataclass(frozen=True)
class AsyncTimes:
    """One timed ``async_save``: seconds to its return (the stall) and to its commit, and whether a
    mirror exchange of an earlier save was still running when it started (on this rank)."""

    stall: float
    committed: float
    overlapped: bool


def timed_async_save(r: Rank, writer: TieredWriter, *, back_to_back: bool) -> AsyncTimes:
    """One ``async_save`` (THREAD) timed to its return and to its commit, then waited for until
    mirrored. ``back_to_back``: a first save is waited for to its commit only, and the timed one
    starts at once, while that save's mirror exchange may still run."""
    if back_to_back:
        first = r.next_id()
        dcp.async_save(
            r.state,
            storage_writer=writer,
            checkpoint_id=first,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        ).result()
    checkpoint_id = r.next_id()
    running = not writer.wait_mirrored(0)
    started = time.perf_counter()
    future = dcp.async_save(
        r.state,
        storage_writer=writer,
        checkpoint_id=checkpoint_id,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    stall = time.perf_counter() - started
    future.result()
    committed = time.perf_counter() - started
    wait_mirrored(r, writer, checkpoint_id)
    if writer.config.mirror_of(writer.tier_name) is not None:
        check_mirrored(r, writer, checkpoint_id)
    retire(writer, keep=checkpoint_id)
    return AsyncTimes(stall, committed, running)


def measure_stalls(r: Rank, mirrored: TieredWriter, unmirrored: TieredWriter) -> None:
    """Rounds of four sides in a rotating order: async_save with and without mirroring, each
    alone (the previous save committed and mirrored) and back to back (see ``timed_async_save``)."""
    nbytes = state_bytes(r.state)
    gap = r.job.gap * max(1.0, nbytes / 2**30)
    names = ["mirror", "no mirror", "mirror, back to back", "no mirror, back to back"]
    sides: list[Callable[[], AsyncTimes]] = [
        lambda: timed_async_save(r, mirrored, back_to_back=False),
        lambda: timed_async_save(r, unmirrored, back_to_back=False),
        lambda: timed_async_save(r, mirrored, back_to_back=True),
        lambda: timed_async_save(r, unmirrored, back_to_back=True),
    ]
    overlapped = []
    for index in range(r.job.reps + 1):  # round 0 allocates the staging buffers: not counted
        stalls: dict[str, float] = {}
        commits: dict[str, float] = {}
        for shift in range(len(sides)):
            side = (index + shift) % len(sides)
            dist.barrier()
            times = sides[side]()
            stalls[names[side]] = r.slowest(times.stall)
            commits[names[side]] = r.slowest(times.committed)
            if side == 2:
                overlapped.append(all(gather(times.overlapped)))
            time.sleep(gap)
        if not index:
            continue
        for name, stall in stalls.items():
            r.sample(f"async_save stall (THREAD), {name}", stall, nbytes)
        for name in names[:2]:
            r.sample(f"async_save to commit (THREAD), {name}", commits[name], nbytes)
        r.pair("stall with mirror / without (THREAD)", stalls["mirror"] / stalls["no mirror"])
        r.pair(
            "stall, previous mirror still running / without mirror (THREAD)",
            stalls["mirror, back to back"] / stalls["no mirror, back to back"],
        )
        r.pair("commit time with mirror / without (THREAD)", commits["mirror"] / commits["no mirror"])
    r.extra["back to back: previous mirror still running at the timed save (per round)"] = overlapped[1:]
    r.say("stalls done")
