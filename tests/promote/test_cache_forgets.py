"""The promoter's cache forgets what its tier no longer holds: a sidecar runs for weeks, and every
checkpoint that retention deleted left its parsed marker (every rank's files) and part records in
memory for good (found by an adversarial review of 8c375df; 8,640 ids a month at one save per 5 min)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from tests.promote.test_parts_cache import GEN_A, _write_part
from tierstore import TieredWriter
from tierstore.config import Config
from tierstore.promote.discovery import MarkerCache, discover
from tierstore.promote.retention import delete_copy
from tierstore.signing import MarkerTrust


def test_a_deleted_checkpoint_leaves_the_cache(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    tier = config.make_tiers(node=0)[0]
    for checkpoint_id in ("a", "b"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)
    cache = MarkerCache(MarkerTrust())
    assert set(discover(tier, cache)) == {"a", "b"}
    assert {i for _t, i in cache.entries} == {"a", "b"}
    delete_copy(tier, "a", trust=MarkerTrust())
    assert set(discover(tier, cache)) == {"b"}
    assert {i for _t, i in cache.entries} == {"b"}
    assert {i for _t, i in cache.parts_read} <= {"b"}


def test_a_deleted_part_leaves_the_cache(make_config: Callable[..., Config]) -> None:
    tier = make_config("memory").make_tiers(node=1)[0]
    _write_part(tier, GEN_A, 1, 3)
    _write_part(tier, GEN_A, 2, 3)
    cache = MarkerCache(MarkerTrust())
    assert set(discover(tier, cache)) == {"x"}
    assert {i for _t, i in cache.parts_read} == {"x"}
    tier.delete_tree("x")
    assert discover(tier, cache) == {}
    assert cache.parts_read == {}
