"""deploy/tierstore.yaml: the one configuration of every target, validated by tierstore itself."""

from __future__ import annotations

from tests.deploy.contract import CONFIG, config, node_local_prefixes
from tests.deploy.tools import DEPLOY


def test_the_example_config_loads_and_has_the_tiers_the_targets_mount() -> None:
    loaded = config()
    assert [t.type for t in loaded.tiers] == ["memory", "local", "s3"]
    memory = loaded.tiers[0]
    assert getattr(memory, "path", None) == "/dev/shm/tierstore/{node}"
    policies = [loaded.policy(t.name) for t in loaded.tiers]
    assert all(p.keep is not None for p in policies) and policies[2].every is not None
    assert loaded.promote.interval > 0
    assert node_local_prefixes() == {"memory": "/dev/shm/tierstore", "local": "/var/lib/tierstore"}


def test_the_kustomize_copy_is_identical() -> None:
    # kustomize reads only files inside its folder, so the base carries a copy of the config.
    copy = DEPLOY / "kubernetes" / "base" / "tierstore.yaml"
    assert copy.read_bytes() == CONFIG.read_bytes(), f"copy {CONFIG} to {copy}"
