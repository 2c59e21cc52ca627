"""Landing files made ahead of time, so that a mirror exchange receives at the wire's speed.

Receiving into fresh tmpfs pages costs more than the transfer itself, so after each round, when no
other round waits, a holder reserves files of the sizes it just received (``posix_fallocate``), and
the files of the mirror retention drops are recycled as spares (:meth:`Spares.recycle`); on a tmpfs
each spare is also mapped writable, so gloo lands bytes straight in its pages (docs/mirror.md, "The
exchange"). A mapping lives only while its file is a spare or a landing in this process's own
directory: the receiver closes it before the file gets its name, so no committed file is ever mapped
writable. The directory is a staging directory of this process (``.tierstore/staging/<owner>``, locked
for its lifetime): it goes at exit, and cleanup removes it once its process is gone.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from tierstore._platform.forks import close_unshared, open_unshared
from tierstore._platform.mapping import Mapping, is_tmpfs, map_shared
from tierstore._platform.owners import owner_dir_name
from tierstore._platform.runtime import finalize
from tierstore.errors import TierstoreError
from tierstore.ids import writer_staging_dir
from tierstore.tiers import LocalFace, Tier

logger = logging.getLogger(__name__)


def files_of(tier: Tier) -> LocalFace:
    """The local files of the tier a peer mirror lives in (host memory); :class:`TierstoreError`
    for a tier without them."""
    if (local := tier.local) is None:
        raise TierstoreError(f"tier {tier.describe()} has no local files to mirror")
    return local


class Spares:
    """Pre-reserved landing files of one memory tier, by size, and the receive buffers of the
    mirror thread that uses them (one thread: no lock)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._files: dict[int, list[str]] = collections.defaultdict(list)
        self._wanted: Counter[int] = Counter()
        self._directory: str | None = None
        self._buffers: list[torch.Tensor] = []
        self._maps: dict[str, Mapping] = {}
        self._tmpfs: bool | None = None
        self.keep_free = 0
        """Bytes a refill leaves free in the tier's filesystem: the room this node's own next save
        needs (set by each round). Own saves come first; a spare is only a speed-up."""

    def buffers(self, count: int, size: int) -> list[torch.Tensor]:
        """``count`` receive buffers of ``size`` bytes, the same ones every time (their pages stay
        mapped and warm: a fresh buffer of this size costs a page fault per page)."""
        if len(self._buffers) != count or self._buffers[0].numel() != size:
            self._buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(count)]
        return self._buffers

    def take(self, size: int) -> str | None:
        """A reserved file of exactly ``size`` bytes, now the caller's (None when there is none);
        the size is wanted again after this round."""
        self._wanted[size] += 1
        found = self._files.get(size)
        if not found:
            return None
        spare = found.pop()
        if spare not in self._maps:  # recycled by a round that ended just now (back to back)
            self._map(spare, size)
        return spare

    def mapping(self, path: str) -> Mapping | None:
        """The writable shared mapping of the spare ``path`` (one :meth:`take` handed out), its
        pages present, or None (not a tmpfs, or the mapping failed). The caller owns it from here
        and closes it before the file gets its real name."""
        return self._maps.pop(path, None)

    def reserved(self, sizes: list[int]) -> int:
        """How many of the bytes of files of ``sizes`` have a spare waiting (room already taken)."""
        have = Counter({size: len(paths) for size, paths in self._files.items()})
        return sum(size * min(count, have[size]) for size, count in Counter(sizes).items())

    def release_unused(self, sizes: list[int]) -> None:
        """Remove the spares no file of ``sizes`` (this round's) can land in: their room goes back
        to the round, which would otherwise be refused for room only stale spares hold."""
        wanted = Counter(sizes)
        for size, paths in self._files.items():
            while len(paths) > wanted[size]:
                self._drop(paths.pop())

    def recycle(self, path: str, size: int) -> bool:
        """Take the file ``path`` of this tier (a mirror retention drops, its marker already gone)
        as a spare of ``size`` bytes instead of deleting it: its pages exist, so a file landing in
        it skips allocating and zeroing them. Only while this round took more files of that size
        than spares remain, and while holding it leaves :attr:`keep_free` free; the file is
        renamed out of the mirror first, so it is no checkpoint file any more. False (the file
        left where it is, for the caller to delete) otherwise. It is mapped (on a tmpfs) between
        rounds, by :meth:`refill`, or when :meth:`take` hands it out: not here, within the round
        that recycles it, before its end (256 MiB of page tables take about 0.02 s to fill)."""
        local = self.tier.local
        if not size or len(self._files[size]) >= self._wanted[size] or local is None:
            return False
        try:
            into = os.path.join(self._home(), f"mirror-spare-{uuid.uuid4().hex[:12]}")
            with _node_lock(os.path.dirname(self._home())):  # as refill: the ranks in turn
                if _free(self._home()) < self.keep_free:
                    return False
                local.recycle(path, into)
        except (OSError, ValueError) as exc:
            logger.info("peer mirror: %s not recycled (%s): deleted", path, exc)
            return False
        self._files[size].append(into)
        return True

    def discard(self, path: str) -> None:
        """Remove a spare :meth:`take` handed out that never became a landing file."""
        self._drop(path)

    def refill(self, pause: Callable[[], object] = lambda: None) -> None:
        """Reserve a file for every size taken since the last refill, drop spares nobody took, map
        the ones recycled since.

        A spare that would leave less than :attr:`keep_free` free is not made, and errors (no
        room) leave fewer spares: the next round then reserves its pages as it receives.
        ``pause()`` is called before each reservation (the mirror yields to staging there too).
        """
        wanted, self._wanted = self._wanted, Counter()
        for size in list(self._files):
            while len(self._files[size]) > wanted[size]:
                self._drop(self._files[size].pop())
        for size, paths in self._files.items():  # recycled during the round: mapped only now
            for path in paths:
                if path not in self._maps:
                    pause()
                    self._map(path, size)
        try:
            for size, count in wanted.items():
                while size and len(self._files[size]) < count:
                    pause()
                    # Every rank of the node refills against the same keep_free, and rounds end
                    # together: the check and the reservation hold the node's lock, so one rank's
                    # spare is in the free space the next one sees.
                    with _node_lock(os.path.dirname(self._home())):
                        if _free(self._home()) - size < self.keep_free:
                            return
                        made = self._reserve(size)
                    self._map(made, size)  # outside the node's lock: only this process's file
                    self._files[size].append(made)
        except OSError as exc:
            logger.info("peer mirror: no spare landing file (%s): the next round reserves its own", exc)

    def _reserve(self, size: int) -> str:
        path = os.path.join(self._home(), f"mirror-spare-{uuid.uuid4().hex[:12]}")
        fd = open_unshared(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            close_unshared(fd)
            _unlink(path)
            raise
        close_unshared(fd)
        return path

    def _map(self, path: str, size: int) -> None:
        """Map the spare ``path`` writable, its page tables filled now (between rounds), where the
        tier is a tmpfs: there its pages exist (reserved or written before), so a write through
        the mapping never allocates and cannot fail (no SIGBUS). Measured on 256 MiB: 0.03 s for a
        recycled file's pages, 0.10 s for freshly reserved ones, against 0.09 s for the copy that
        a landing through the mapping does not make. Elsewhere, or if mapping fails, nothing: the
        file then lands by copy."""
        if self._tmpfs is None:
            self._tmpfs = is_tmpfs(self._home())
        if not self._tmpfs or not size:
            return
        try:
            fd = open_unshared(path, os.O_RDWR)  # a child forked meanwhile does not keep it
            try:
                if os.fstat(fd).st_size != size:  # a page past the end would be a SIGBUS
                    return
                self._maps[path] = map_shared(fd, size)
            finally:
                close_unshared(fd)  # the mapping keeps no descriptor
        except OSError as exc:
            logger.info("peer mirror: spare %s not mapped (%s): it lands by copy", path, exc)

    def _drop(self, path: str) -> None:
        """Remove a spare and its mapping."""
        mapped = self._maps.pop(path, None)
        if mapped is not None:
            mapped.close()
        _unlink(path)

    def _home(self) -> str:
        if self._directory is None:
            home = files_of(self.tier).own_directory(writer_staging_dir(owner_dir_name()))
            finalize(self, _remove_home, home.path, home.lock)
            self._directory = home.path
        return self._directory


def _free(directory: str) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def _node_lock(directory: str) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (the tier's staging directory, shared by every
    process of the node; no file of its own, so nothing for cleanup to find)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_home(directory: str, lock: int) -> None:
    try:
        for name in os.listdir(directory):
            _unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except FileNotFoundError:
        pass  # gone already (the tier removed with it): nothing of it is left to remove
    except OSError as exc:  # cleanup removes it once this process is gone
        logger.warning("could not remove %s: %s", directory, exc)
    finally:
        os.close(lock)
