"""A marker names the namespace of the run that committed it; a tier reads only its own run's.

Two runs may share tier roots under different namespaces. A marker copied from one into the other
(same checkpoint id) names the other run's generation, files and commit number: taken at its word it
is a newer commit of the id whose data is missing, and a restore would refuse every good copy of
the id in the slower tiers (issue 24, item 5). Refused when read, it is one more damaged copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import Catalog, IntegrityError, TieredReader, TieredWriter, latest_committed
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import read_manifest


def _save(config: Config, checkpoint_id: str) -> None:
    dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def test_a_marker_copied_from_another_namespace_is_refused(make_config: Callable[..., Config]) -> None:
    run, other = make_config("local", namespace="run"), make_config("local", namespace="other")
    _save(other, "x")
    (mine,), (theirs,) = run.make_tiers(node=0), other.make_tiers(node=0)
    assert read_manifest(theirs, "x", trust=other.marker_trust()).namespace == "other"
    mine.publish(marker_path("x"), theirs.read_bytes(marker_path("x")), create_only=True)
    with pytest.raises(IntegrityError) as refused:
        read_manifest(mine, "x", trust=run.marker_trust())
    assert "x/commit.json: marker of namespace 'other' in a tier of namespace 'run'" in str(refused.value)
    assert Catalog(run).listings() == []
    assert latest_committed(run, collective=False) is None


def test_a_marker_without_a_namespace_is_read_anywhere(make_config: Callable[..., Config]) -> None:
    config = make_config("local", namespace="run")
    _save(config, "x")
    (tier,) = config.make_tiers(node=0)
    body = json.loads(tier.read_bytes(marker_path("x")))
    del body["namespace"]  # a marker written before the field
    tier.publish(marker_path("x"), json.dumps(body).encode(), create_only=False)
    assert read_manifest(tier, "x", trust=config.marker_trust()).namespace is None
    assert latest_committed(config, collective=False) == "x"


def test_a_foreign_marker_in_a_mirrored_memory_tier_gives_way_to_the_next_tier(
    make_config: Callable[..., Config],
) -> None:
    """The mirrored memory tier reads markers through its own path (each node's copy and the peer
    mirrors it holds); a marker of another run there must be refused the same way, so the restore
    falls back to the next tier instead of refusing it as older than the foreign commit."""
    tiers = {"memory": {"mirror": True}}
    run = make_config("memory", "local", namespace="run", tiers=tiers)
    other = make_config("memory", "local", namespace="other", tiers=tiers)
    for checkpoint_id in ("a", "b", "x"):  # the foreign x is that run's third commit
        _save(other, checkpoint_id)
    dcp.save({"w": torch.full((8,), 7.0)}, storage_writer=TieredWriter(run), checkpoint_id="x")
    assert Promoter(run).run(once=True) == 0
    (memory, _local), (theirs, _) = run.make_tiers(node=0), other.make_tiers(node=0)
    memory.publish(marker_path("x"), theirs.read_bytes(marker_path("x")), create_only=False)
    state = {"w": torch.zeros(8)}
    dcp.load(state, storage_reader=TieredReader(run, collective=False), checkpoint_id="x")
    assert torch.equal(state["w"], torch.full((8,), 7.0))
