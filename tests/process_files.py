"""What files this process holds: mapped (``/proc/self/maps``) or open (``/proc/self/fd``), by inode."""

from __future__ import annotations

import os
from pathlib import Path

from tests.mirror_jobs import memory_root


def mapped_inodes() -> set[int]:
    """The inodes of the files this process has mapped."""
    fields = (line.split() for line in Path("/proc/self/maps").read_text().splitlines())
    return {int(f[4]) for f in fields if len(f) >= 6 and f[4] != "0"}


def open_inodes() -> set[int]:
    """The inodes of the files this process has open."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
    return inodes


def own_checkpoint_files(root: Path, node: int, checkpoint_id: str) -> dict[int, str]:
    """``node``'s own files of ``checkpoint_id`` in its memory tier (not mirrors, not spares), by
    inode."""
    return {
        p.stat().st_ino: str(p)
        for p in memory_root(root, node).rglob("*")
        if p.is_file() and checkpoint_id in p.parts and ".tierstore" not in p.parts
    }
