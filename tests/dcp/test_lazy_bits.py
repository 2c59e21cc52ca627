"""Tensors carrying a lazy conjugate or negation bit are saved and restored by their values.

``x.conj()`` and ``torch._neg_view(x)`` share ``x``'s memory and flip a bit that every read honours;
raw bytes written from, or read into, that memory must go through the bit too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter
from tierstore.config import Config

pytestmark = pytest.mark.slow  # every lazy-bit kind on every tier type: ~10 s of the quick lane

KINDS = ["memory", "local", "s3"]


def _values() -> torch.Tensor:
    return torch.randn(2048, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))


LAZY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"conj": torch.conj, "neg": torch._neg_view}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bit", sorted(LAZY))
def test_a_destination_with_a_lazy_bit_receives_the_values(
    kind: str, bit: str, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind)
    values = _values()
    dcp.save({"c": values}, storage_writer=TieredWriter(config), checkpoint_id="step_000001")
    destination = LAZY[bit](torch.zeros_like(values))
    dcp.load({"c": destination}, storage_reader=TieredReader(config), checkpoint_id="step_000001")
    assert torch.equal(destination, values)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bit", sorted(LAZY))
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_tensor_with_a_lazy_bit_is_saved_by_its_values(
    kind: str, bit: str, how: str, make_config: Callable[..., Config]
) -> None:
    config = make_config(kind)
    source = LAZY[bit](_values())
    writer = TieredWriter(config)
    if how == "save":
        dcp.save({"c": source}, storage_writer=writer, checkpoint_id="step_000001")
    else:
        dcp.async_save({"c": source}, storage_writer=writer, checkpoint_id="step_000001").result()
    restored = torch.zeros(2048, dtype=torch.complex64)
    dcp.load({"c": restored}, storage_reader=TieredReader(config), checkpoint_id="step_000001")
    assert torch.equal(restored, source)
