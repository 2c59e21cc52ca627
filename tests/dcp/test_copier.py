"""The slab copy: exact bytes in chunks on several threads, copy_ for what is not plain memory, fork."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.forked import in_forked_child
from tierstore import TieredReader, TieredWriter
from tierstore.config import Config
from tierstore.dcp.layout import memory_of
from tierstore.dcp.staging.copier import CHUNK, can_move, move


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sources() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(CHUNK // 4 * 3 + 5, generator=generator),  # three chunks and a tail
        torch.randn(CHUNK // 4, generator=generator),  # exactly one chunk
        torch.randn(33, 17, generator=generator).to(torch.bfloat16),
        torch.randint(-128, 127, (1001,), dtype=torch.int8, generator=generator),
        torch.rand(77, generator=generator) > 0.5,
        torch.empty(0, 3),
        torch.tensor(2.5, dtype=torch.float64),
    ]


def test_every_byte_arrives_whatever_the_sizes(two_threads: None) -> None:
    pairs = [(torch.full_like(s, 1) if s.dtype != torch.bool else torch.zeros_like(s), s) for s in sources()]
    move(pairs)
    for destination, source in pairs:
        assert torch.equal(destination, source), (source.dtype, tuple(source.shape))


def test_a_large_copy_is_shared_with_a_helper_thread(two_threads: None) -> None:
    source = torch.randn(CHUNK // 4 * 16)
    destination = torch.zeros_like(source)
    move([(destination, source)])
    assert torch.equal(destination, source)
    helpers = [t for t in threading.enumerate() if t.name == "tierstore-copy"]
    assert helpers and all(t.daemon for t in helpers), "no helper thread took part"


def test_only_plain_contiguous_cpu_memory_is_moved() -> None:
    plain = torch.randn(8, 4)
    assert can_move(torch.empty(8, 4), plain)
    assert not can_move(torch.empty(4, 8), plain.t()), "a transposed view is strided"
    assert not can_move(torch.empty(8, 4, dtype=torch.float64), plain), "another dtype"
    assert not can_move(torch.empty(4, 8), plain), "another shape"
    complex_values = torch.randn(5, dtype=torch.complex64)
    assert not can_move(torch.empty(5, dtype=torch.complex64), complex_values.conj())
    assert not can_move(torch.empty(5), torch._neg_view(torch.randn(5))), "a lazy negation"
    assert not can_move(torch.empty(8, 4), torch.nn.Parameter(plain)), "a subclass: copy_"
    assert can_move(torch.empty(8, 4), torch.nn.Parameter(plain).detach())
    assert not can_move(torch.empty(4), torch._efficientzerotensor(4)), "no memory behind it"


def test_a_forked_child_copies_with_helpers_of_its_own(two_threads: None) -> None:
    """The parent's helper threads do not exist in a forked child: a copy there must not wait for
    them (it would hang). The child runs no torch operation of its own: after a fork, torch's
    OpenMP pool hangs the first parallel one (``zeros_like`` included), with or without tierstore."""
    source = torch.randn(CHUNK // 4 * 8)
    move([(torch.zeros_like(source), source)])  # the parent's helpers are running
    destination = torch.zeros_like(source)

    def copy_in_child() -> int:
        move([(destination, source)])
        return 0 if memory_of(destination) == memory_of(source) else 2

    status = in_forked_child(copy_in_child, deadline=30)
    assert os.WIFEXITED(status), f"the child's copy hung ({status})"
    assert os.WEXITSTATUS(status) == 0, "the child's copy was wrong"
    assert not torch.equal(destination, source), "the parent's destination is its own"


def mixed_state(seed: int) -> dict[str, Any]:
    """Tensors the slab copy moves as memory, and tensors it must leave to ``copy_``."""
    generator = torch.Generator().manual_seed(seed)
    complex_values = torch.randn(300, dtype=torch.complex64, generator=generator)
    return {
        "large": torch.randn(CHUNK // 4 * 2 + 3, generator=generator),
        "transposed": torch.randn(40, 30, generator=generator).t(),
        "conj": complex_values.conj(),
        "neg": torch._neg_view(torch.randn(50, generator=generator)),
        "parameter": torch.nn.Parameter(torch.randn(12, 7, generator=generator)),
        "bf16": torch.randn(99, generator=generator).to(torch.bfloat16),
        "mask": torch.rand(31, generator=generator) > 0.5,
        "empty": torch.empty(0, 5),
        "zeros": torch._efficientzerotensor(6),  # no memory behind it (a memmove crashed)
    }


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_slab_saves_keep_every_kind_of_tensor(
    kind: str, make_config: Callable[..., Config], two_threads: None
) -> None:
    """Saves after the first copy into a slab (a memory tier's first save does not): every tensor
    comes back with its values, whichever way it was copied."""
    config = make_config(kind)
    writer = TieredWriter(config)
    for index in range(3):
        dcp.async_save(mixed_state(index), storage_writer=writer, checkpoint_id=f"step_{index:04d}").result()
    assert writer._staged.slab is not None, "the last save copied into a slab"
    for index in range(3):
        expected = mixed_state(index)
        target = {k: torch.zeros_like(v.detach()) for k, v in expected.items()}
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id=f"step_{index:04d}")
        for key, value in expected.items():
            assert torch.equal(target[key], value.detach().resolve_conj().resolve_neg()), key
    writer.close()
