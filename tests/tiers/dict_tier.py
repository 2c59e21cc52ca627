"""A small tier type that exists only in the tests: objects in a Python dict, shared per ``store``.

It proves that a tier type is one module plus one registration: nothing in ``tierstore`` names it, yet
the contract suite and a DCP round trip run against it. It has no capabilities beyond the verbs.

It also carries the faults the protocol's model (``tests/records/test_model.py``) injects, outside
the code under test: :data:`FAULTS` can make a store *slow*, take it *down* (every verb raises
:class:`~tierstore.errors.TierUnavailableError`, an outage) or *crash* the caller after a number of
verbs (:class:`SimulatedCrash`, and every later verb too until :meth:`Faults.revive`: a process killed
between two store operations does nothing more).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar, Literal

from pydantic import Field

from tierstore.errors import TierUnavailableError
from tierstore.tiers import FileInfo, RetryHook, Tier, TierConfig, register

_STORES: dict[str, dict[str, tuple[bytes, float]]] = {}
_LOCK = threading.Lock()


class SimulatedCrash(BaseException):
    """The calling actor is dead from this verb on (a kill between two store operations)."""


class Faults:
    """Outages and crashes for the tests' dict tiers (process-wide, like the stores)."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        """Stores (the ``store`` field) that answer nothing."""
        self.crash_after: int | None = None
        """Verbs left before the crash (None: no crash armed)."""
        self.crashed = False
        self.slow: dict[str, float] = {}
        """Seconds every verb of a store takes (a throttled bucket, a loaded filesystem)."""

    def arm(self, verbs: int) -> None:
        """Crash the caller at its ``verbs``-th next verb (0: at the next)."""
        self.crash_after, self.crashed = verbs, False

    def revive(self) -> bool:
        """Disarm; True if a crash happened since :meth:`arm`."""
        crashed, self.crash_after, self.crashed = self.crashed, None, False
        return crashed

    def check(self, store: str) -> None:
        """Called by every verb first."""
        if self.crashed:
            raise SimulatedCrash("already dead")
        if self.crash_after is not None:
            if self.crash_after <= 0:
                self.crashed = True
                raise SimulatedCrash("killed between two store operations")
            self.crash_after -= 1
        if store in self.down:
            raise TierUnavailableError(f"tier store {store} is down (simulated outage)")
        time.sleep(self.slow.get(store, 0.0))


FAULTS = Faults()


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        self.data += memoryview(data).cast("B")
        return len(data)


class DictTier(Tier):
    """Objects in a process-wide dict: visible only once written whole, like an object store."""

    def __init__(self, name: str, store: str, namespace: str | None) -> None:
        self.name, self.type, self.node_local = name, "dict", False
        self.store = store
        self.root = f"dict://{store}/{namespace or ''}".rstrip("/")
        with _LOCK:
            self.objects = _STORES.setdefault(self.root, {})

    @contextmanager
    def open_write(self, path: str) -> Iterator[_Buffer]:
        FAULTS.check(self.store)
        buffer = _Buffer()
        yield buffer
        FAULTS.check(self.store)
        with _LOCK:
            self.objects[path] = (bytes(buffer.data), time.time())

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        FAULTS.check(self.store)
        with _LOCK:
            if create_only and path in self.objects:
                raise FileExistsError(path)
            self.objects[path] = (data, time.time())

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self._get(path)[0]
        return data[offset:] if length is None else data[offset : offset + length]

    def stat(self, path: str) -> FileInfo:
        data, mtime = self._get(path)
        return FileInfo(path, len(data), mtime)

    def _get(self, path: str) -> tuple[bytes, float]:
        FAULTS.check(self.store)
        with _LOCK:
            if path not in self.objects:
                raise FileNotFoundError(path)
            return self.objects[path]

    def list_dir(self, path: str = "") -> list[str]:
        FAULTS.check(self.store)
        prefix = f"{path}/" if path else ""
        with _LOCK:
            keys = [k for k in self.objects if k.startswith(prefix)]
        return sorted({k[len(prefix) :].split("/", 1)[0] for k in keys})

    def find(self, path: str = "", *, after: str | None = None) -> list[FileInfo]:
        FAULTS.check(self.store)
        prefix = f"{path}/" if path else ""
        with _LOCK:
            items = [(k, v) for k, v in self.objects.items() if k.startswith(prefix) and k > (after or "")]
        return sorted((FileInfo(k, len(v[0]), v[1]) for k, v in items), key=lambda f: f.path)

    def delete(self, path: str) -> None:
        FAULTS.check(self.store)
        with _LOCK:
            self.objects.pop(path, None)

    def delete_tree(self, path: str) -> None:
        for info in self.find(path):
            self.delete(info.path)


@register
class DictTierConfig(TierConfig):
    """``type: dict``: objects kept in this process, in the store called ``store``."""

    type: Literal["dict"]
    store: str = Field("default", description="Tiers naming the same store share their objects.")

    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> DictTier:
        return DictTier(self.name, self.store, namespace)


@register
class NodeDictTierConfig(TierConfig):
    """``type: nodedict``: a dict tier per node (a simulated node's memory); ``{node}`` in ``store``
    names each node's store."""

    type: Literal["nodedict"]
    store: str = Field("node{node}", description="Each node's store; {node} is its index.")
    node_local: ClassVar[bool] = True

    def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> DictTier:
        tier = DictTier(self.name, self.store.replace("{node}", str(node)), namespace)
        tier.node_local = True
        return tier
