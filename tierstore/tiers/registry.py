"""Tier types by name. A tier type is one module that calls :func:`register` with its config model.

The model (a :class:`~tierstore.tiers.base.TierConfig` subclass with ``type: Literal["<name>"]``)
carries the YAML fields, the load-time checks and the ``build`` factory; the :class:`Tier` it builds
declares its capabilities. Nothing else in tierstore names a tier type.
"""

from __future__ import annotations

import typing

from tierstore.tiers.base import RetryHook, Tier, TierConfig

_TYPES: dict[str, type[TierConfig]] = {}


def register(model: type[TierConfig]) -> type[TierConfig]:
    """Register a tier type's config model under the name its ``type`` field admits.

    Usable as a class decorator. Registering another model under a taken name raises ValueError.
    """
    annotation = model.model_fields["type"].annotation
    names = typing.get_args(annotation)
    if typing.get_origin(annotation) is not typing.Literal or len(names) != 1:
        raise ValueError(f"{model.__name__}.type must be declared as Literal['<type name>']")
    name = str(names[0])
    if _TYPES.get(name, model) is not model:
        raise ValueError(f"tier type {name!r} is already registered by {_TYPES[name].__name__}")
    _TYPES[name] = model
    return model


def tier_types() -> tuple[str, ...]:
    """The registered type names, in registration order."""
    return tuple(_TYPES)


def config_model(type_name: str) -> type[TierConfig] | None:
    """The config model registered for ``type_name``, or None."""
    return _TYPES.get(type_name)


def make_tier(
    config: TierConfig, *, namespace: str | None, node: int, on_retry: RetryHook | None = None
) -> Tier:
    """Build the adapter for one configured tier, as seen from ``node`` (see :meth:`TierConfig.build`)."""
    return config.build(namespace=namespace, node=node, on_retry=on_retry)
