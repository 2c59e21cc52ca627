"""DCP's own signal that a ``dcp.save`` call has returned, per thread.

DCP reports the start, end and exception of every ``dcp.save`` call (and of its phases) as events
on its event logger (``torch.distributed.checkpoint.logger``); a record carries the thread that
made the call. :func:`watch` hands out an event that is set when the next ``save`` on a given thread
ends or raises: after its collectives, whether it committed or failed. The back-pressure rule
(:mod:`tierstore.dcp.pending`) uses it for saves carried by a long-lived thread, which never ends.

The handler is installed once per process, on first use; it only looks up the thread in a dict.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
import torch.distributed.checkpoint.logger as dcp_logger

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


class _Watchers(logging.Handler):
    """Sets the watched threads' events when their ``save`` call returns."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._guard = threading.Lock()  # not `lock`: logging.Handler holds that one around emit()
        self.pid = os.getpid()
        self.by_thread: dict[int, list[threading.Event]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message: Any = record.msg
        if not isinstance(message, dict) or message.get("event") not in _OVER:
            return
        if message.get("func_name") not in _SAVE_CALLS or record.thread is None:
            return
        with self._guard:
            if self.pid != os.getpid():  # a forked child: the parent's threads are not here
                self.pid, self.by_thread = os.getpid(), {}
            events = self.by_thread.pop(record.thread, [])
        for event in events:
            event.set()

    def watch(self, thread: threading.Thread) -> threading.Event:
        returned = threading.Event()
        with self._guard:
            if self.pid != os.getpid():
                self.pid, self.by_thread = os.getpid(), {}
            self.by_thread.setdefault(thread.ident or -1, []).append(returned)
        return returned

    def forget(self, thread: threading.Thread, returned: threading.Event) -> None:
        with self._guard:
            events = self.by_thread.get(thread.ident or -1, [])
            if returned in events:
                events.remove(returned)
            if not events:
                self.by_thread.pop(thread.ident or -1, None)


_install_lock = threading.Lock()
_watchers: _Watchers | None = None


def _installed() -> _Watchers:
    global _watchers
    with _install_lock:
        if _watchers is None:
            _watchers = _Watchers()
            _event_logger().addHandler(_watchers)
        return _watchers


def watch(thread: threading.Thread) -> threading.Event:
    """An event set when the next ``dcp.save`` call on ``thread`` returns or raises. Call it from
    inside that save (before it can return), e.g. from the writer's first call on the thread."""
    return _installed().watch(thread)


def forget(thread: threading.Thread, returned: threading.Event) -> None:
    """Stop watching (the save is known to be over another way, e.g. its thread ended)."""
    _installed().forget(thread, returned)
