"""DCP's own signal that a ``dcp.save`` call has returned, per thread.

DCP reports the start, end and exception of every ``dcp.save`` call (and of its phases) as events
on its event logger (``torch.distributed.checkpoint.logger``); a record carries the thread that
made the call. :func:`watch`, called from inside a ``save``, hands out an event that is set when
that call ends or raises: after its collectives, whether it committed or failed. A save started
inside it (a planner that saves something else) ends first and does not count. The back-pressure rule
(:mod:`tierstore.dcp.staging.pending`) uses it for saves carried by a long-lived thread, which never ends.

The handler is installed at import; it only looks up the thread in a dict.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed.checkpoint.logger as dcp_logger

from tierstore._platform.runtime import ProcessLocal

_SAVE_CALLS = frozenset({"save"})
"""DCP calls whose end means a save is over (``save_state_dict``, deprecated, reports nothing)."""
_OVER = frozenset({"end", "exception"})


def _event_logger() -> logging.Logger:
    found = getattr(dcp_logger, "_dcp_logger", None)
    if not isinstance(found, logging.Logger):
        raise RuntimeError(
            f"torch {torch.__version__} has no DCP event logger (torch.distributed.checkpoint"
            ".logger._dcp_logger): tierstore needs it to learn when a save has returned;"
            " use the torch version pinned in tierstore's constraints"
        )
    return found


class _Watched:
    """This process's threads inside ``dcp.save`` and the events waiting for those saves to end
    (per process: a forked child does not have the parent's threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth: dict[int, int] = {}
        """Thread id -> ``dcp.save`` calls open on it (a save may run another inside it)."""
        self.waiting: dict[int, list[tuple[int, threading.Event]]] = {}
        """Thread id -> (the depth of the watched save, its event)."""


_WATCHED = ProcessLocal(_Watched)


class _SaveEnds(logging.Handler):
    """Counts each thread's open ``dcp.save`` calls and sets the events of those that end.

    Attached to DCP's logger itself, so it runs on the thread that made the call: the thread is
    ``threading.get_ident()``, whatever ``logging.logThreads`` says."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        message: Any = record.msg
        if not isinstance(message, dict) or message.get("func_name") not in _SAVE_CALLS:
            return
        event, thread = message.get("event"), threading.get_ident()
        watched = _WATCHED.get()
        with watched.lock:
            level = watched.depth.get(thread, 0)
            if event == "start":
                watched.depth[thread] = level + 1
                return
            if event not in _OVER or level == 0:  # an end whose start was not seen
                return
            if level == 1:
                del watched.depth[thread]
            else:
                watched.depth[thread] = level - 1
            waiting = watched.waiting.get(thread, [])
            ended = [done for depth, done in waiting if depth >= level]
            waiting[:] = [(depth, done) for depth, done in waiting if depth < level]
            if not waiting:
                watched.waiting.pop(thread, None)
        for done in ended:
            done.set()


_event_logger().addHandler(_SaveEnds())


def watch() -> threading.Event | None:
    """From inside a ``dcp.save`` call: an event set when that call (not one it makes inside
    itself) returns or raises, on this thread. None when DCP's events do not reach tierstore, so
    that no event will come: the call is the deprecated ``dcp.save_state_dict`` (which reports
    none), or records are off (``logging.disable``, or DCP's logger disabled)."""
    if not _event_logger().isEnabledFor(logging.DEBUG):
        return None
    thread, watched = threading.get_ident(), _WATCHED.get()
    with watched.lock:
        depth = watched.depth.get(thread, 0)
        if depth == 0:
            return None
        returned = threading.Event()
        watched.waiting.setdefault(thread, []).append((depth, returned))
    return returned


def forget(thread: threading.Thread, returned: threading.Event) -> None:
    """Stop watching (the save is known to be over another way, e.g. its thread ended)."""
    watched = _WATCHED.get()
    with watched.lock:
        waiting = watched.waiting.get(thread.ident or -1, [])
        waiting[:] = [(depth, done) for depth, done in waiting if done is not returned]
        if not waiting:
            watched.waiting.pop(thread.ident or -1, None)
