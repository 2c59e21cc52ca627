"""A stand-in for a previous checkpoint's background work: copy a file with a CRC32C, in another process.

While a checkpoint is persisted or promoted, the next save's copy competes with it for cores and memory
bandwidth. :class:`BackgroundLoad` reproduces that cost the same way for every side of a comparison: a
long-lived child process that, on each :meth:`~BackgroundLoad.start`, reads a source file of the state's
size from tmpfs, computes its CRC32C and writes it into a new file in another tmpfs directory (what a
promoter does), then deletes that file. The child is started once, so no measurement pays for a Python
start-up, and :meth:`~BackgroundLoad.start` returns only once the child has read and written its first
chunk: the save measured next always begins with the load under way.

Run as a script it is that child (``python benchmarks/load.py SOURCE DESTINATION_DIR``): one line on stdin
starts a copy, it answers ``started`` then ``done``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import TracebackType

CHUNK = 8 * 2**20


class BackgroundLoad:
    """A child process that copies ``source`` (with a CRC32C) into ``directory`` on demand.

    Use as a context manager; :meth:`start` and :meth:`wait` alternate.
    """

    def __init__(self, source: Path, directory: Path) -> None:
        self.source = source
        self.directory = directory
        self._child: subprocess.Popen[str] | None = None

    def __enter__(self) -> BackgroundLoad:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._child = subprocess.Popen(
            [sys.executable, __file__, str(self.source), str(self.directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        child = self._child
        if child is not None and child.stdin is not None:
            child.stdin.close()  # end of input: the child exits
            child.wait(timeout=60)

    def start(self) -> None:
        """Begin one copy; returns once the child has copied its first chunk."""
        self._send()
        self._expect("started")

    def wait(self) -> None:
        """Wait for the copy begun by :meth:`start` to end."""
        self._expect("done")

    def _send(self) -> None:
        assert self._child is not None and self._child.stdin is not None, "use as a context manager"
        self._child.stdin.write("go\n")
        self._child.stdin.flush()

    def _expect(self, word: str) -> None:
        assert self._child is not None and self._child.stdout is not None
        line = self._child.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"background load answered {line!r}, expected {word!r}")


def make_source(path: Path, nbytes: int) -> None:
    """Write ``nbytes`` of non-zero data to ``path`` (tmpfs pages, all touched)."""
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, CHUNK)])


def copy_once(source: str, directory: str) -> None:
    """The load itself: read, CRC32C, write into a new file; then delete it (untimed by the parent)."""
    from tierstore.checksum import crc32c

    target = os.path.join(directory, "load.bin")
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    checksum = 0
    announced = False
    with open(source, "rb", buffering=0) as reader, open(target, "wb", buffering=0) as writer:
        while count := reader.readinto(buffer):
            checksum = crc32c(view[:count], checksum)
            writer.write(view[:count])
            if not announced:
                print("started", flush=True)
                announced = True
    if not announced:
        print("started", flush=True)
    os.unlink(target)
    print("done", flush=True)


def main() -> None:
    source, directory = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    for _ in sys.stdin:
        copy_once(source, directory)


if __name__ == "__main__":
    main()
