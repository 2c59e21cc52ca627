"""latest_committed and the catalog: decided by markers, newest by step then commit time."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from tierstore import Catalog, TieredWriter, latest_committed
from tierstore.catalog import newest_first
from tierstore.config import Config
from tierstore.ids import marker_path, step_of
from tierstore.tiers import make_tier


def test_step_parsing() -> None:
    assert step_of("step_000200") == 200
    assert step_of("run3-epoch2-step1500") == 1500
    assert step_of("final") is None


def test_newest_first_rule() -> None:
    ordered = newest_first(
        [("step_10", 5.0), ("step_9", 9.0), ("final", 100.0), ("best", 50.0), ("step_10b", 1.0)]
    )
    assert ordered == ["step_10", "step_10b", "step_9", "final", "best"]


def _save(config: Config, checkpoint_id: str, tier: str | None = None) -> None:
    dcp.save(
        {"x": torch.arange(4)},
        storage_writer=TieredWriter(config, tier=tier),
        checkpoint_id=checkpoint_id,
    )


def test_latest_across_tiers_and_none_when_empty(make_config: Callable[..., Config]) -> None:
    config = make_config("memory", "local", "s3")
    assert latest_committed(config) is None
    _save(config, "step_000100")
    _save(config, "step_000300", tier="s3")
    _save(config, "step_000200", tier="local")
    assert latest_committed(config) == "step_000300"
    scanned = Catalog(config).scan()
    assert scanned.keys() == {"step_000100", "step_000200", "step_000300"}
    assert set(scanned["step_000300"]) == {"s3"}


def test_directories_without_markers_do_not_count(make_config: Callable[..., Config]) -> None:
    config = make_config("memory")
    _save(config, "step_000001")
    _save(config, "step_000002")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    tier.delete(marker_path("step_000002"))
    tier.write_bytes("step_000009/gdeadbeef00/junk", b"no marker here")
    assert latest_committed(config) == "step_000001"


def test_corrupt_newest_marker_is_skipped(make_config: Callable[..., Config]) -> None:
    config = make_config("local")
    _save(config, "step_000001")
    _save(config, "step_000002")
    tier = make_tier(config.tiers[0], namespace=None, node=0)
    tier.publish(marker_path("step_000002"), b"garbage", create_only=False)
    assert latest_committed(config) == "step_000001"
