"""Who owns a staging directory: ``<host>~<pid>~<random>``, so gc can tell a dead writer's files."""

from __future__ import annotations

import os
import socket
import uuid


def owner_dir_name() -> str:
    """``<host>~<pid>~<random>``: whose staging files these are (gc removes those of dead owners)."""
    return f"{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"


def owner_is_gone(name: str) -> bool:
    """True when a staging directory's owner process no longer runs (judged on its own host only)."""
    parts = name.split("~")
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False  # another host's, or not ours to judge
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


__all__ = ["owner_dir_name", "owner_is_gone"]
