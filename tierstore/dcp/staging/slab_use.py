"""Who is using a staging slab right now: saves reading its views out, or a stage copying into it.

The back-pressure rule (:mod:`tierstore.dcp.staging.pending`) keeps the next stage away from the save it
follows, but a failed save may be retried on another thread, which no rule can see coming. So every
save that writes out views of a slab holds the slab for *reading* while it checks their stage's
token and writes them; a stage holds it for *staging* while it writes the header and copies. Either
waits for the other: a retry that comes first is written whole before the next stage copies, and
one that comes later finds the new header and is refused (``StaleStagedStateError``).

Slabs are found by the address of their storage: a save only has the views' storage in hand.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch

from tierstore._platform.runtime import ProcessLocal

logger = logging.getLogger(__name__)
_WARN_EVERY_S = 60.0


class SlabUse:
    """A readers-writer lock for one slab: many saves reading, or one stage copying."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._readers = 0
        self._staging = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the slab while a save checks and writes out views of it."""
        with self._changed:
            self._changed.wait_for(lambda: not self._staging)
            self._readers += 1
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """Hold the slab while a stage writes its header and copies into it; a wait for a save
        still writing it out (which may be stuck on its tier) is logged every minute."""
        started = time.monotonic()
        with self._changed:
            while not self._changed.wait_for(
                lambda: not self._staging and not self._readers, timeout=_WARN_EVERY_S
            ):
                logger.warning(
                    "staging has waited %.0f s for %d save(s) still writing this staging buffer out",
                    time.monotonic() - started,
                    self._readers,
                )
            self._staging = True
        try:
            yield
        finally:
            with self._changed:
                self._staging = False
                self._changed.notify_all()


class _Uses:
    """The locks of this process's live slabs, by address. Per process: a forked child stages into
    slabs of its own (its writers' stagers are per process)."""

    def __init__(self) -> None:
        self.by_address: dict[int, SlabUse] = {}
        self.lock = threading.Lock()


_USES = ProcessLocal(_Uses)


def register(storage: torch.UntypedStorage) -> SlabUse:
    """A new slab's lock, findable from any view of ``storage``."""
    use, uses = SlabUse(), _USES.get()
    with uses.lock:
        uses.by_address[storage.data_ptr()] = use
    return use


def unregister(storage: torch.UntypedStorage, use: SlabUse) -> None:
    """Forget a released slab (unless its address already belongs to a newer one)."""
    uses = _USES.get()
    with uses.lock:
        if uses.by_address.get(storage.data_ptr()) is use:
            del uses.by_address[storage.data_ptr()]


def use_of(storage: torch.UntypedStorage) -> SlabUse | None:
    """The lock of the slab ``storage`` is, or None (not a live slab of this process)."""
    uses = _USES.get()
    with uses.lock:
        return uses.by_address.get(storage.data_ptr())
