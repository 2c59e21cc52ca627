"""A signed checkpoint whose partner's mirror holds a file forged to keep its CRC32C: it is never
restored from. The holder checks its mirrored files' signed SHA-256 when it offers them for a
restore (so the copy is not complete, and the restore goes to the next tier), and the receiver
checks each file it is sent against the signed SHA-256 as well (a file swapped between the offer
and the send; these bytes may hold byte items DCP unpickles)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.mirror_jobs import become, memory_root, mirror_config, save_steps
from tests.workers import run_ranks
from tierstore import latest_committed
from tierstore.checksum import crc32c
from tierstore.config import Config

KEY = "a-job-key-of-at-least-32-bytes-for-tests-0123456789"
TWO_NODES = (0, 0, 1, 1)


def forge_keeping_crc32c(data: bytes, at: int) -> bytes:
    """``data`` with 4 bytes at ``at`` flipped and 4 bytes at ``at + 8`` set so that the CRC32C
    stays the same (CRC is linear over GF(2): the second window's bits are solved for)."""
    size, base = len(data), crc32c(bytes(len(data)))

    def effect(patch: dict[int, int]) -> int:  # CRC change of XOR-ing ``patch`` into zeros
        raw = bytearray(size)
        for position, value in patch.items():
            raw[position] = value
        return crc32c(bytes(raw)) ^ base

    target = effect({at + i: 0xFF for i in range(4)})
    columns = [effect({at + 8 + bit // 8: 1 << (bit % 8)}) for bit in range(32)]
    chosen = 0  # Gaussian elimination over GF(2): the bits whose columns XOR to ``target``
    basis: list[tuple[int, int]] = []  # (vector, the bits it combines), distinct leading bits
    for bit, column in enumerate(columns):
        reduced, combination = column, 1 << bit
        for vector, combo in basis:
            if reduced ^ vector < reduced:
                reduced, combination = reduced ^ vector, combination ^ combo
        if reduced:
            basis.append((reduced, combination))
            basis.sort(reverse=True)
    remaining = target
    for vector, combo in basis:
        if remaining ^ vector < remaining:
            remaining, chosen = remaining ^ vector, chosen ^ combo
    assert remaining == 0
    forged = bytearray(data)
    for i in range(4):
        forged[at + i] ^= 0xFF
        forged[at + 8 + i] ^= (chosen >> (8 * i)) & 0xFF
    assert crc32c(bytes(forged)) == crc32c(data) and bytes(forged) != data
    return bytes(forged)


def no_copy_to_restore(rank: int, world: int, config: Config, layout: Sequence[int]) -> None:
    """Restart on ``layout``: no tier holds a trustworthy complete copy, so nothing restores."""
    become(layout[rank])
    assert latest_committed(config, node=layout[rank]) is None


def test_a_mirrored_file_forged_to_keep_its_crc32c_is_never_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)  # the rank processes inherit it
    config = mirror_config(tmp_path)  # the lower tiers stay empty: host memory is all there is
    run_ranks(save_steps, 4, tmp_path, config, TWO_NODES, (1,), "sync", tmp_path)
    # Node 1 is replaced; node 0 holds its mirror. Forge node 1's rank-2 data file there.
    shutil.rmtree(memory_root(tmp_path, 1))
    (data,) = (memory_root(tmp_path, 0) / ".tierstore" / "mirror" / "step_1").glob("g*/r00002-0.distcp")
    data.write_bytes(forge_keeping_crc32c(data.read_bytes(), 64))
    run_ranks(no_copy_to_restore, 4, tmp_path, config, TWO_NODES)
