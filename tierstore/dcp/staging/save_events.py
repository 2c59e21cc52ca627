"""DCP's own signal that a ``dcp.save`` call has returned, per thread.

DCP reports the start, end and exception of every ``dcp.save`` call (and of its phases) as events
on its event logger (``torch.distributed.checkpoint.logger``); a record carries the thread that
made the call. :func:`watch` hands out an event that is set when the next ``save`` on a given thread
ends or raises: after its collectives, whether it committed or failed. The back-pressure rule
(:mod:`tierstore.dcp.staging.pending`) uses it for saves carried by a long-lived thread, which never ends.

The handler is installed at import; it only looks up the thread in a dict.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed.checkpoint.logger as dcp_logger

from tierstore.runtime import ProcessLocal

_SAVE_CALLS = frozenset({"save"})
"""DCP calls whose end means a save is over (``save_state_dict``, deprecated, reports no end)."""
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
    """The events of this process's watched threads, by thread id (per process: a forked child
    does not have the parent's threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_thread: dict[int, list[threading.Event]] = {}


_WATCHED = ProcessLocal(_Watched)


class _SaveEnds(logging.Handler):
    """Sets the watched threads' events when their ``save`` call returns."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        message: Any = record.msg
        if not isinstance(message, dict) or message.get("event") not in _OVER:
            return
        if message.get("func_name") not in _SAVE_CALLS or record.thread is None:
            return
        watched = _WATCHED.get()
        with watched.lock:
            events = watched.by_thread.pop(record.thread, [])
        for event in events:
            event.set()


_event_logger().addHandler(_SaveEnds())


def watch(thread: threading.Thread) -> threading.Event:
    """An event set when the next ``dcp.save`` call on ``thread`` returns or raises. Call it from
    inside that save (before it can return), e.g. from the writer's first call on the thread."""
    returned, watched = threading.Event(), _WATCHED.get()
    with watched.lock:
        watched.by_thread.setdefault(thread.ident or -1, []).append(returned)
    return returned


def forget(thread: threading.Thread, returned: threading.Event) -> None:
    """Stop watching (the save is known to be over another way, e.g. its thread ended)."""
    watched = _WATCHED.get()
    with watched.lock:
        events = watched.by_thread.get(thread.ident or -1, [])
        if returned in events:
            events.remove(returned)
        if not events:
            watched.by_thread.pop(thread.ident or -1, None)
