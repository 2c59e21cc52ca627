"""``memory`` tier: a tmpfs directory on each node (default ``/dev/shm/tierstore``).

The fastest tier: a save's staging buffers are files in this directory, so staging *is* the write
(see :mod:`tierstore.dcp.staging`). It survives the trainer process, not the node.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from tierstore.placement import MirrorConfig
from tierstore.tiers.base import RetryHook
from tierstore.tiers.posix import PosixTier, PosixTierConfig, join_namespace
from tierstore.tiers.registry import register


class MemoryTier(PosixTier):
    """Host memory (tmpfs), node-local; writers stage saves in files here."""

    staging = True

    def __init__(self, name: str, directory: str) -> None:
        super().__init__(name, "memory", directory, node_local=True)


@register
class MemoryTierConfig(PosixTierConfig):
    """Host memory: a tmpfs directory on each node (default ``/dev/shm/tierstore``)."""

    type: Literal["memory"]
    path: str = "/dev/shm/tierstore"
    mirror: MirrorConfig | None = Field(
        None,
        description="Also hold every node's committed files in a partner node's host memory"
        " (true, or a mapping with stride/timeout).",
    )
    node_local: ClassVar[bool] = True

    @field_validator("mirror", mode="before")
    @classmethod
    def _mirror_shorthand(cls, value: Any) -> Any:
        return MirrorConfig.from_yaml(value)

    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> MemoryTier:
        """The tier on ``node`` (host memory never retries: no ``on_retry``)."""
        directory = join_namespace(self.path_for(node), namespace)
        return MemoryTier(self.name, directory)
