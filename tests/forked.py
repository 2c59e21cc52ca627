"""Running a check in a forked child of the test process, with a deadline."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def in_forked_child(check: Callable[[], int], *, deadline: int = 60) -> int:
    """Fork, run ``check`` in the child (its return value is the exit code), return the raw status.

    A child still running after ``deadline`` seconds is killed by SIGALRM (``os.WIFEXITED`` is then
    false: a hang). The child never returns into pytest: it ends with ``os._exit``; an exception
    in ``check`` exits 1.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(deadline)
            code = check()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status
