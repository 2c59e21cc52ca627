"""Where a received mirror file lands: a hidden temp file beside its target, or a spare reserved ahead.

A tier with local files hands one out (:meth:`LocalFace.open_landing`) to the peer mirror's receiver.
Its pages are reserved before the first byte arrives (``posix_fallocate``; a spare's were reserved
between rounds, :mod:`tierstore.dcp.mirror.spares`): a tier without room refuses the file at once
with ENOSPC, and the writes that follow only fill pages that exist (a spare on a tmpfs is written
through its mapping instead, made between rounds: :mod:`tierstore.dcp.mirror.transport`). The file
gets its real name only through the tier's ``adopt`` (rename, fsync the directory) once its bytes
are checked; until then its name is a temporary one, which cleanup recognises. Its descriptor is one
a forked child closes at once (:mod:`tierstore._platform.forks`): a DataLoader worker forked during a
receive must not hold the file's pages after retention removes it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from tierstore._platform.forks import close_unshared, open_unshared
from tierstore.tiers.durable import in_dirs, temp_name_for


class Landing:
    """A temp file of ``size`` bytes beside ``target``, or ``spare``, a file of that size reserved
    beforehand in the same filesystem (one of another size is cut or grown to it, its pages
    reserved: its old bytes past ``size`` never stay), open for writing at any offset.

    Raises :class:`OSError` (ENOSPC when the filesystem has no room) with nothing left behind.
    """

    def __init__(self, target: str, size: int, spare: str | None = None) -> None:
        if spare is None:
            self.temp = temp_name_for(Path(target), uuid.uuid4().hex[:12])
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            self._fd = in_dirs(self.temp.parent, lambda: open_unshared(str(self.temp), flags, 0o644))
        else:
            self.temp = Path(spare)
            self._fd = open_unshared(str(self.temp), os.O_WRONLY)
        try:
            if spare is not None and os.fstat(self._fd).st_size != size:
                # A spare is made for one size; one of another would keep old bytes past the
                # new file's end (the CRC32C covers only what arrives), or have no pages there.
                os.ftruncate(self._fd, size)
                spare = None
            if spare is None and size:
                os.posix_fallocate(self._fd, 0, size)
        except BaseException:
            self.discard()
            raise

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write all of ``data`` at ``offset``."""
        while data:
            done = os.pwrite(self._fd, data, offset)
            data, offset = data[done:], offset + done

    def seal(self) -> str:
        """Make the bytes durable (fsync) and return the file's path, for the tier's ``adopt``."""
        os.fsync(self._fd)
        close_unshared(self._fd)
        self._fd = -1
        return str(self.temp)

    def discard(self) -> None:
        """Close and remove the file if it still has its temporary (or spare) name; after
        ``adopt`` it has not."""
        if self._fd >= 0:
            close_unshared(self._fd)
            self._fd = -1
        self.temp.unlink(missing_ok=True)
