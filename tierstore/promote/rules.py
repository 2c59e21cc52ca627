"""The policy's rules read from a configuration: the one place where the YAML's retention and
promotion fields (each tier's :class:`~tierstore.policy_config.TierPolicy`: ``keep``,
``keep_every``, ``pin``, ``every``; ``promote.every`` and ``promote.stale_after``) become
:class:`~tierstore.promote.policy.Rules`, so that the policy itself stays a pure module that imports
no configuration."""

from __future__ import annotations

from tierstore.config import Config
from tierstore.promote.policy import Rules, TierRules
from tierstore.tiers import TierConfig


def rules_of(config: Config) -> Rules:
    """The promotion and retention rules of ``config``."""
    return Rules(
        tiers=tuple(_tier_rules(config, tier) for tier in config.tiers),
        durable_every=config.promote.every,
        stale_after=config.promote.stale_after,
    )


def _tier_rules(config: Config, tier: TierConfig) -> TierRules:
    """One tier's rules: its policy fields, and whether each node has its own copy (storage)."""
    policy = config.policy(tier.name)
    return TierRules(
        name=tier.name,
        node_local=tier.node_local,
        keep=policy.keep,
        keep_every=policy.keep_every,
        pin=policy.pin,
        every=policy.every,
    )
