"""``export_checkpoint``: committed copies become plain DCP directories that torch's own reader loads.

Every load here goes through ``torch.distributed.checkpoint.FileSystemReader``, never tierstore, and
is compared bit for bit with the state that was saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.guarantees.test_multinode import save_on_two_nodes, tensors
from tests.guarantees.test_multirank import GLOBAL, save_world2
from tests.training import Trainer, assert_same, fresh_target
from tests.workers import run_ranks
from tierstore import TieredWriter, export_checkpoint
from tierstore.config import Config
from tierstore.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

ID = "step_000002"


def odd_tensors() -> dict[str, torch.Tensor]:
    """Dtypes and shapes the model lacks: each must survive the raw -> torch.save conversion."""
    generator = torch.Generator().manual_seed(5)
    return {
        "bf16": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
        "f64_scalar": torch.tensor(3.25, dtype=torch.float64),
        "complex": torch.randn(5, generator=generator, dtype=torch.complex64),
        "bool": torch.rand(9, generator=generator) > 0.5,
        "int8": torch.arange(-5, 6, dtype=torch.int8),
        "empty": torch.empty(0, 4),
    }


def save_state(config: Config, *, use_async: bool = False) -> Trainer:
    """Train a little and save (``dcp.save`` or ``dcp.async_save``) through ``TieredWriter``."""
    trainer = Trainer(seed=0)
    trainer.train(2)
    state = {**trainer.state(), "odd": odd_tensors()}
    writer = TieredWriter(config)
    if use_async:
        dcp.async_save(state, storage_writer=writer, checkpoint_id=ID).result()
        writer.close()
    else:
        dcp.save(state, storage_writer=writer, checkpoint_id=ID)
    return trainer


def load_with_torch(directory: Path) -> tuple[Trainer, dict[str, Any]]:
    """Load an exported directory with torch's FileSystemReader into a differently seeded state."""
    target, state = fresh_target()
    state["odd"] = {k: torch.zeros_like(v) for k, v in odd_tensors().items()}
    state["extra"] = b""
    dcp.load(state, storage_reader=FileSystemReader(directory))
    target.restore(state)
    return target, state


def assert_exported_matches(directory: Path, expected: Trainer) -> None:
    target, state = load_with_torch(directory)
    assert_same(expected.state(), target.state())
    assert_same(odd_tensors(), state["odd"], "odd")
    assert state["extra"] == expected.state()["extra"], "a byte item came through changed"
    assert state["step"] == 2, "a non-tensor object item came through changed"


@pytest.mark.parametrize(
    ("kind", "use_async"), [("memory", True), ("local", False), ("shared", True), ("s3", False)]
)
def test_export_from_each_tier_type_loads_bit_exact_with_torchs_reader(
    kind: str, use_async: bool, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind)
    trainer = save_state(config, use_async=use_async)
    dest = tmp_path / "exports" / "step2"
    report = export_checkpoint(config, ID, dest)
    assert (report.checkpoint_id, report.tier) == (ID, kind)
    written = sorted(p.name for p in dest.iterdir())
    assert ".metadata" in written and report.files == len(written)
    assert report.bytes == sum(p.stat().st_size for p in dest.iterdir())
    assert sorted(p.name for p in dest.parent.iterdir()) == ["step2"], "a temporary dir was left"
    assert_exported_matches(dest, trainer)


def test_exported_directory_loads_where_tierstore_cannot_be_imported(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    save_state(config)
    dest = tmp_path / "plain"
    export_checkpoint(config, ID, dest)
    converted = tmp_path / "whole.pt"
    code = (  # tierstore made unimportable: the directory and its pickle must not need it
        "import sys; sys.modules['tierstore'] = None\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"dcp_to_torch_save({str(dest)!r}, {str(converted)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True)
    loaded = torch.load(converted, weights_only=False)
    assert_same(odd_tensors(), loaded["odd"], "odd")
    assert loaded["extra"] == Trainer(seed=0).state()["extra"]


def test_a_two_rank_save_exports_and_loads_resharded_in_one_process(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    run_ranks(save_world2, 2, tmp_path, config, True)  # async, DTensor Shard(0) over 2 ranks
    dest = tmp_path / "two_ranks"
    report = export_checkpoint(config, "step_000002", dest)
    assert report.tier == "memory"
    names = {p.name for p in dest.iterdir()}
    assert any(n.startswith("r00000") for n in names) and any(n.startswith("r00001") for n in names)
    expected = Trainer(seed=11)
    expected.train(2)
    target, state = fresh_target()
    state["sharded"] = torch.zeros_like(GLOBAL)  # one plain tensor from two ranks' shards
    dcp.load(state, storage_reader=FileSystemReader(dest))
    target.restore(state)
    assert_same(expected.state(), target.state())
    assert torch.equal(state["sharded"], GLOBAL)


def test_a_node_local_copy_split_over_nodes_falls_back_to_a_complete_one(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "shared")
    run_ranks(save_on_two_nodes, 2, tmp_path, config, 3)  # rank r on node r, memory tier
    with pytest.raises(CheckpointNotFoundError) as missing:
        export_checkpoint(config, "step_0003", tmp_path / "none", node=0)
    assert "rank(s) [1] saved on other nodes" in str(missing.value)
    assert "shared" in str(missing.value) and "no commit marker" in str(missing.value)
    assert not (tmp_path / "none").exists()

    Promoter(config, node=1).run_once()  # node 1's part reaches the shared tier
    Promoter(config, node=0).run_once()  # node 0's too, and the marker
    dest = tmp_path / "from_shared"
    assert export_checkpoint(config, "step_0003", dest, node=0).tier == "shared"
    state = {"model": {k: torch.zeros_like(v) for k, v in tensors(3).items()}, "step": 0}
    dcp.load(state, storage_reader=FileSystemReader(dest))
    assert all(torch.equal(state["model"][k], v) for k, v in tensors(3).items())
    assert state["step"] == 3
    with pytest.raises(CheckpointNotFoundError, match=r"rank\(s\) \[1\] saved on other nodes"):
        export_checkpoint(config, "step_0003", tmp_path / "forced", tier="memory", node=0)


@pytest.mark.parametrize("damaged", ["data", "metadata"])
def test_a_corrupt_source_byte_fails_and_leaves_nothing(
    damaged: str, tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    save_state(config)
    ram = config.make_tier("memory", node=0)
    manifest = read_manifest(ram, ID, trust=MarkerTrust())
    entry = next(f for f in manifest.files if (f.rank is None) == (damaged == "metadata"))
    path = f"{ID}/{entry.path}"
    raw = bytearray(ram.read_bytes(path))
    raw[len(raw) // 2] ^= 0x10
    ram.write_bytes(path, bytes(raw))
    dest = tmp_path / "exports" / "bad"
    with pytest.raises(IntegrityError) as failed:
        export_checkpoint(config, ID, dest)
    message = str(failed.value)
    assert message.startswith(f"tier memory: {path}: CRC32C "), message
    assert f"marker says {entry.crc32c:08x}" in message
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == [], "the temporary directory was left behind"


def test_an_existing_directory_is_refused_unless_empty(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    trainer = save_state(config)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_checkpoint(config, ID, full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_checkpoint(config, ID, afile)
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(config, ID, empty)
    assert_exported_matches(empty, trainer)


def test_tier_selects_a_slower_copy_and_unknown_names_fail(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory", "local")
    trainer = save_state(config)
    Promoter(config).run_once()  # the same generation now in local too
    assert export_checkpoint(config, ID, tmp_path / "fast").tier == "memory"
    report = export_checkpoint(config, ID, tmp_path / "slow", tier="local")
    assert report.tier == "local"
    assert_exported_matches(tmp_path / "slow", trainer)
    assert json.loads(json.dumps(report.as_dict()))["tier"] == "local"
    with pytest.raises(ConfigError, match="no tier named 'tape'"):
        export_checkpoint(config, ID, tmp_path / "x", tier="tape")
    with pytest.raises(CheckpointNotFoundError, match="'step_000009'"):
        export_checkpoint(config, "step_000009", tmp_path / "y", tier="local")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
