"""A save of staged state that fails with ENOSPC after its slab became the checkpoint's data file,
then a retry of the same staged state once space is back (issue 22, row 11).

The memory tier is a real, small tmpfs. The failing save adopts (renames) its staging slab as file 0,
then runs out of room writing file 1 (the byte items), and its failure cleanup removes the adopted
file. The staged views still map the slab's pages, so the retry can write exactly the staged bytes
out again: it must commit them bit-exact (never a raw ``FileNotFoundError`` on the old slab path),
and the checkpoint committed before must stay intact.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import TieredReader, TieredWriter
from tierstore.cli.audit import audit_all
from tierstore.config import Config, config_from_dict
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

_ELEMENTS = 1 << 20
"""``w`` is 4 MiB of float32: the slab's bulk."""
_BLOB = 1 << 20
"""The byte item (file 1) is 1 MiB: more than the room left when the save fails."""
_LEFT = 256 << 10
"""Free bytes left on the tmpfs for the failing save: its records fit, its file 1 does not."""


def train_state(step: int) -> dict[str, Any]:
    """A state with one large tensor (staged into the slab) and one large byte item (file 1)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(_ELEMENTS, generator=generator),
        "blob": bytes([step % 256]) * _BLOB,
        "step": step,
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``state``: what the checkpoint must hold after the trainer moves on."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def stage(writer: TieredWriter, state: dict[str, Any]) -> dict[str, Any]:
    """``writer.stage(state)``: without ``overlap`` the staged views themselves."""
    staged = writer.stage(state)
    assert isinstance(staged, dict)
    return staged


def async_save(state: dict[str, Any], writer: TieredWriter, checkpoint_id: str) -> None:
    """``dcp.async_save`` and wait for its commit (or its failure)."""
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    assert isinstance(future, Future)
    future.result()


def assert_restores(config: Config, checkpoint_id: str, expected: dict[str, Any]) -> None:
    """``checkpoint_id`` loads back bit-exact to ``expected``."""
    target: dict[str, Any] = {"w": torch.zeros(_ELEMENTS), "blob": b"", "step": -1}
    dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=checkpoint_id)
    assert torch.equal(target["w"], expected["w"]), f"{checkpoint_id}: w differs"
    assert target["blob"] == expected["blob"] and target["step"] == expected["step"], checkpoint_id


def fill(memory: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of the tmpfs at ``memory`` with a file of foreign data."""
    stats = os.statvfs(memory)
    free = stats.f_bavail * stats.f_frsize
    filler = memory / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, free - leave)
    finally:
        os.close(fd)
    return filler


def data_size(config: Config, checkpoint_id: str) -> int:
    """The size of rank 0's file 0 in ``checkpoint_id``'s marker (memory tier)."""
    manifest = read_manifest(config.make_tiers(node=0)[0], checkpoint_id, trust=MarkerTrust())
    return next(f.size for f in manifest.files if f.path.endswith("r00000-0.distcp"))


@pytest.fixture
def memory_config(mount_tmpfs: Callable[[str], Path]) -> tuple[Config, Path]:
    """A config whose only tier is a memory tier on a fresh 32 MiB tmpfs."""
    memory = mount_tmpfs("32m")
    tiers = [{"name": "ram", "type": "memory", "path": str(memory)}]
    return config_from_dict({"tiers": tiers}), memory


def fail_a_save_after_adoption(
    config: Config, memory: Path, writer: TieredWriter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Commit ``step_1`` (async), then fail ``step_2`` with ENOSPC after its slab was adopted.

    Returns step 1's state and step 2's staged state, with space freed again.
    """
    first = train_state(1)
    writer.prepare(first)  # step 1's data file is then an adopted slab too
    async_save(first, writer, "step_1")
    stager = writer._stager_for_this_process()
    assert stager is not None
    stager.wait_until_prepared()  # step 2 stages into the (fully allocated) spare
    assert stager.spare is not None and stager.spare.path is not None
    slab_path = stager.spare.path
    filler = fill(memory, _LEFT)
    state = train_state(2)
    staged = stage(writer, state)
    state["w"].add_(100.0)  # the trainer moves on: the staged copy must not
    with pytest.raises(CheckpointException, match=r"TierUnavailableError.*No space left"):
        dcp.save(staged, storage_writer=writer, checkpoint_id="step_2")
    assert not os.path.exists(slab_path), "the failed save had adopted the slab"
    filler.unlink()  # space is freed
    return first, staged


def retry_with_the_same_writer(config: Config, writer: TieredWriter, staged: dict[str, Any]) -> None:
    """The same writer saves the staged state again (it still names the adopted slab)."""
    dcp.save(staged, storage_writer=writer, checkpoint_id="step_2")


def retry_with_a_new_writer(config: Config, writer: TieredWriter, staged: dict[str, Any]) -> None:
    """``storage_writer=TieredWriter(config)`` on every save: the retry has no slab of its own."""
    dcp.save(staged, storage_writer=TieredWriter(config), checkpoint_id="step_2")


def retry_async(config: Config, writer: TieredWriter, staged: dict[str, Any]) -> None:
    """``async_save`` again of the same staged views: they are staged again, then saved."""
    async_save(staged, writer, "step_2")


@pytest.mark.parametrize("retry", [retry_with_the_same_writer, retry_with_a_new_writer, retry_async])
def test_a_retry_of_the_staged_state_commits_the_staged_bytes(
    memory_config: tuple[Config, Path], retry: Callable[[Config, TieredWriter, dict[str, Any]], None]
) -> None:
    """The retry writes the slab's still-mapped pages out: step 2 holds exactly the staged bytes,
    and step 1 stays intact."""
    config, memory = memory_config
    writer = TieredWriter(config)
    try:
        first, staged = fail_a_save_after_adoption(config, memory, writer)
        expected = snapshot(staged)
        retry(config, writer, staged)
        assert_restores(config, "step_2", expected)
        assert_restores(config, "step_1", first)
        assert [a for a in audit_all(config, [0]) if not a.ok] == []
        if retry is retry_with_the_same_writer:
            assert writer._staged.slab is not None
            assert data_size(config, "step_2") == writer._staged.slab.nbytes, "file 0 is the whole slab"
    finally:
        writer.close()


def test_a_staged_state_saved_again_under_another_id_commits_the_same_bytes(
    make_config: Callable[..., Config],
) -> None:
    """A committed save adopted the slab; the same staged state saved again (another id) writes
    the slab's pages out, and the first checkpoint stays intact."""
    config = make_config("memory")
    writer = TieredWriter(config)
    try:
        state = train_state(3)
        writer.prepare(state)
        writer._stager_for_this_process().wait_until_prepared()
        staged = stage(writer, state)
        expected = snapshot(staged)
        state["w"].zero_()
        dcp.save(staged, storage_writer=writer, checkpoint_id="step_3")
        dcp.save(staged, storage_writer=writer, checkpoint_id="step_3_copy")
        assert_restores(config, "step_3", expected)
        assert_restores(config, "step_3_copy", expected)
        assert [a for a in audit_all(config, [0]) if not a.ok] == []
    finally:
        writer.close()
