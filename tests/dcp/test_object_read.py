"""Reading most of a data object: ranged GETs cut by :func:`pieces`, streamed into the tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter
from tierstore.config import Config
from tierstore.dcp.restore.objects import SKIP_GAP, Piece, pieces


def _spans(*ranges: tuple[int, int]) -> list[tuple[int, memoryview]]:
    return [(offset, memoryview(bytearray(length))) for offset, length in ranges]


def _shape(found: list[Piece]) -> list[tuple[int, list[int]]]:
    return [(p.offset, [len(o) for o in p.outs]) for p in found]


def test_adjacent_items_share_a_get_cut_at_the_chunk_size() -> None:
    assert _shape(pieces(_spans((64, 100), (164, 250), (414, 10)), chunk=200)) == [
        (64, [100, 100]),
        (264, [150, 10]),
    ]


def test_padding_is_read_into_scratch_and_a_large_gap_is_skipped() -> None:
    found = pieces(_spans((0, 10), (64, 10), (74 + SKIP_GAP + 1, 10)), chunk=1000)
    assert _shape(found) == [(0, [10, 54, 10]), (74 + SKIP_GAP + 1, [10])]


def test_empty_items_take_no_bytes_and_overlapping_items_are_refused() -> None:
    assert _shape(pieces(_spans((0, 0), (0, 10), (10, 0)), chunk=8)) == [(0, [8]), (8, [2])]
    with pytest.raises(ValueError, match="overlap"):
        pieces(_spans((0, 10), (5, 10)), chunk=100)


@pytest.mark.slow  # several seconds of S3 requests: make test runs it, make quick does not
def test_a_restore_from_s3_fills_every_kind_of_destination_bit_exactly(
    make_config: Callable[..., Config],
) -> None:
    """Large tensors over several 5 MiB GETs, small ones sharing a GET across padding, a
    non-contiguous destination (decoded from its own buffer), an empty tensor, byte items."""
    config = make_config("s3")
    generator = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3 * 2**20 + 17, generator=generator),
        "bias": torch.randn(7, generator=generator),
        "square": torch.randn(300, 300, generator=generator),
        "ints": torch.randint(0, 2**30, (1000,), generator=generator),
        "empty": torch.empty(0),
        "extra": {"step": 5, "names": ["a", "b"]},
    }
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id="step_000005")
    square = torch.zeros(300, 300).t()  # a transposed view: not the stored layout
    target = {
        "big": torch.zeros_like(state["big"]),
        "bias": torch.zeros(7),
        "square": square,
        "ints": torch.zeros(1000, dtype=torch.int64),
        "empty": torch.empty(0),
        "extra": {"step": 0, "names": []},
    }
    memory = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id="step_000005")
    assert reader.chosen_tier == "s3"
    for key in ("big", "bias", "square", "ints", "empty"):
        assert torch.equal(target[key], state[key]), key
        assert target[key].data_ptr() == memory[key], f"{key} restored into its own memory"
    assert target["extra"] == state["extra"]


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_one_stored_chunk_loaded_into_two_local_shards_from_s3(make_config: Callable[..., Config]) -> None:
    """Resharding gives this rank two items over the same stored bytes (a table split in two
    local shards, as torchrec's are): one GET serves both."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    config = make_config("s3")
    full = torch.arange(64 * 1024, dtype=torch.float32).reshape(1024, 64)
    dcp.save({"w": full}, storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:0/cpu"])
    sharded = sharded_tensor.zeros(spec, 1024, 64)
    dcp.load({"w": sharded}, storage_reader=TieredReader(config), checkpoint_id="step_000001")
    assert torch.equal(torch.cat([s.tensor for s in sharded.local_shards()]), full)
