"""A tier's retention and promotion fields: :class:`TierPolicy`, kept apart from its storage fields.

In the YAML they sit on each ``tiers`` entry beside the storage keys (``path``, ``url``, ...), as
docs/configuration.md shows; :func:`split_entry` parts an entry at load, so that the tier type's
model (:mod:`tierstore.tiers`) holds only storage and knows nothing of retention or promotion, and
the promoter's rules (:mod:`tierstore.promote.rules`) read only this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from tierstore.ids import validate_checkpoint_id
from tierstore.units import StrictModel


class TierPolicy(StrictModel):
    """One tier's retention (``keep``, ``keep_every``, ``pin``) and promotion (``every``) fields."""

    keep: int | None = Field(None, ge=1, description="Retention: keep the N newest committed.")
    keep_every: int | None = Field(None, ge=1, description="Retention: also keep steps % M == 0.")
    pin: tuple[str, ...] = Field((), description="Retention: ids never deleted from this tier.")
    every: int | None = Field(
        None, ge=1, description="Promotion: every k-th committed checkpoint reaches this tier."
    )

    @field_validator("pin")
    @classmethod
    def _pins_are_ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            validate_checkpoint_id(item)
        return value


POLICY_KEYS: tuple[str, ...] = tuple(TierPolicy.model_fields)
"""The keys of a ``tiers`` entry that belong to :class:`TierPolicy`, in their documented order."""


def split_entry(entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(storage keys, policy keys)`` of one raw ``tiers`` entry; every key lands in one of them
    (an unknown key stays with the storage keys, whose model names it)."""
    storage = {k: v for k, v in entry.items() if k not in POLICY_KEYS}
    return storage, {k: v for k, v in entry.items() if k in POLICY_KEYS}


def entry_order(storage_fields: Mapping[str, object]) -> dict[str, int]:
    """The position of each key of a ``tiers`` entry as the YAML documents it (``type``, ``name``,
    the policy keys, then the tier type's own); errors and dumps follow it, unknown keys last."""
    head = [k for k in ("type", "name") if k in storage_fields]
    rest = [k for k in storage_fields if k not in head]
    return {key: index for index, key in enumerate([*head, *POLICY_KEYS, *rest])}


def merge_entry(storage: Mapping[str, Any], policy: Mapping[str, Any]) -> dict[str, Any]:
    """One ``tiers`` entry again, storage and policy keys in the order :func:`entry_order` gives
    (what a dump of the configuration writes, so that it loads back as it was)."""
    order = entry_order(storage)
    merged = {**storage, **policy}
    return dict(sorted(merged.items(), key=lambda item: order.get(item[0], len(order))))
