"""The policy's rules read from a configuration: the one place where the YAML's retention and
promotion fields (each tier's ``keep``, ``keep_every``, ``pin``, ``every``; ``promote.every`` and
``promote.stale_after``) become :class:`~tierstore.promote.policy.Rules`, so that the policy itself
stays a pure module that imports no configuration."""

from __future__ import annotations

from tierstore.config import Config
from tierstore.promote.policy import Rules, TierRules


def rules_of(config: Config) -> Rules:
    """The promotion and retention rules of ``config``."""
    return Rules(
        tiers=tuple(
            TierRules(
                name=tier.name,
                node_local=tier.node_local,
                keep=tier.keep,
                keep_every=tier.keep_every,
                pin=tuple(tier.pin),
                every=tier.every,
            )
            for tier in config.tiers
        ),
        durable_every=config.promote.every,
        stale_after=config.promote.stale_after,
    )
