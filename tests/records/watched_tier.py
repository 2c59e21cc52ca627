"""A review-only tier type: a POSIX directory every node sees (like ``shared``) whose every verb is
counted per root, and which can be taken down (every verb raises TierUnavailableError): a slow or
far tier (S3) whose requests a test can count, or whose outage it can simulate, with nothing in
tierstore patched.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Literal

from tierstore.errors import TierUnavailableError
from tierstore.tiers import RetryHook
from tierstore.tiers.posix import PosixTier, PosixTierConfig, join_namespace
from tierstore.tiers.registry import config_model, register

CALLS: Counter[str] = Counter()
"""Verbs called per tier root."""
DOWN: set[str] = set()
"""Roots that answer nothing (an outage)."""
_LOCK = threading.Lock()

_VERBS = (
    "open_write",
    "publish",
    "adopt",
    "read_range",
    "read_into",
    "stat",
    "list_dir",
    "find",
    "find_in_children",
    "incomplete_writes",
    "delete",
    "remove_if_empty",
    "delete_tree",
)


class WatchedTier(PosixTier):
    def _gate(self) -> None:
        with _LOCK:
            CALLS[self.root] += 1
        if self.root in DOWN:
            raise TierUnavailableError(f"tier {self.name} is down (simulated outage)")


def _wrap(name: str) -> None:
    inner = getattr(PosixTier, name)

    def verb(self: WatchedTier, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return inner(self, *args, **kwargs)

    verb.__name__ = name
    setattr(WatchedTier, name, verb)


for _name in _VERBS:
    _wrap(_name)


if config_model("watched") is None:

    @register
    class WatchedTierConfig(PosixTierConfig):
        """``type: watched``: a counted, breakable shared directory (review tests only)."""

        type: Literal["watched"]

        def build(
            self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None
        ) -> WatchedTier:
            return WatchedTier(self.name, "watched", join_namespace(self.path, namespace), node_local=False)
