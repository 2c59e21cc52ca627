"""Why a drill rank failed, in one line: the innermost tierstore error, not DCP's nested tracebacks.

A checkpoint that fails its checks in a drill raises inside ``dcp.load``. DCP wraps each rank's error
in a ``CheckpointException`` whose text is every rank's traceback, and a failed ``read_metadata``
reaches the caller only as the text of an ``AssertionError`` ("metadata is None; global metadata
read failed: ..."). The line that matters (``...r00001-0.distcp: CRC32C 10f1a2de, marker says
4170053c``) is deep inside. :func:`failure_cause` finds it; :class:`WatchedReader` keeps the error
DCP reduces to text. A step function that exits while parsing its arguments (``ctx.argv``, the
arguments after ``--``) is told apart from tierstore's own options by :func:`exit_cause`.

Each rank's log goes to its stderr one line per record, without tracebacks, unless verbose
(:func:`set_up_rank_logging`): DCP logs a failed load with its traceback.
"""

from __future__ import annotations

import io
import logging
import traceback
from typing import IO, Any

from torch.distributed.checkpoint.api import CheckpointException

from tierstore.dcp.restore import TieredReader
from tierstore.errors import TierstoreError, one_line

_KEEP = 64 * 1024
"""Characters of a rank's stderr :class:`Tee` keeps."""


class WatchedReader(TieredReader):
    """The drill's reader: keeps the tierstore error its ``read_metadata`` raised (in ``error``)."""

    error: TierstoreError | None = None

    def read_metadata(self, *args: Any, **_ignored: Any) -> Any:
        """:meth:`TieredReader.read_metadata`, remembering its error. (The variadic keyword
        parameter keeps its name: DCP passes ``rank=`` only to one literally named ``kwargs``.)"""
        try:
            return super().read_metadata(*args, **_ignored)
        except TierstoreError as exc:
            self.error = exc
            raise


class Tee(io.StringIO):
    """Writes through to ``stream`` and keeps the end of what passed (what the entry printed)."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self._stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` to the stream, and keep it."""
        self._stream.write(text)
        written = super().write(text)
        if self.tell() > _KEEP * 16:
            kept = self.getvalue()[-_KEEP:]
            self.seek(0)
            self.truncate()
            super().write(kept)
        return written

    def flush(self) -> None:
        """Flush the stream."""
        self._stream.flush()


class OneLineFormatter(logging.Formatter):
    """Each record on one line, its traceback left out."""

    def format(self, record: logging.LogRecord) -> str:
        """The record's line, without ``exc_info`` or stack."""
        plain = logging.makeLogRecord(
            {**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None}
        )
        return one_line(super().format(plain))


def set_up_rank_logging(rank: int, verbose: bool) -> None:
    """Log this rank's records to stderr, prefixed with the rank: WARNING and above on one line
    each; ``verbose``: INFO and above, with tracebacks."""
    handler = logging.StreamHandler()
    line = f"drill rank {rank}: %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(line) if verbose else OneLineFormatter(line))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def _inner(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``: what DCP gathered from the ranks, then its cause or context."""
    inner: list[BaseException] = []
    if isinstance(exc, CheckpointException):
        inner += [failure for failure, _trace in exc.failures.values()]
    if exc.__cause__ is not None:
        inner.append(exc.__cause__)
    elif exc.__context__ is not None and not exc.__suppress_context__:
        inner.append(exc.__context__)
    return inner


def failure_cause(exc: BaseException, *, fallback: TierstoreError | None = None) -> str:
    """Why a drill rank failed, in one line: the message of the innermost tierstore error inside
    ``exc`` (through DCP's gathered failures, causes and contexts); else ``fallback`` (an error DCP
    kept only as text); else the innermost exception's own line (``Type: message``)."""
    found: tuple[int, TierstoreError] | None = None
    deepest: tuple[int, BaseException] = (0, exc)
    pending: list[tuple[int, BaseException]] = [(0, exc)]
    seen: set[int] = set()
    while pending:
        depth, current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, TierstoreError) and (found is None or depth > found[0]):
            found = (depth, current)
        if depth > deepest[0]:
            deepest = (depth, current)
        pending += [(depth + 1, inner) for inner in reversed(_inner(current))]
    if found is not None:
        return one_line(str(found[1]))
    if fallback is not None:
        return one_line(str(fallback))
    innermost = deepest[1]
    return one_line(traceback.format_exception_only(type(innermost), innermost)[-1])


def exit_cause(exc: SystemExit, printed: str, *, entry: str, argv: tuple[str, ...]) -> str:
    """Why the step function called ``sys.exit``, ``printed`` being what it wrote to stderr: mostly
    its own argument parser refusing ``argv`` (whose complaint, such as a missing ``--config``,
    reads like tierstore's own): say whose arguments they are, and how to pass them."""
    refused = [line.strip() for line in printed.splitlines() if ": error: " in line]
    given = f"given after --: {' '.join(argv)}" if argv else "none given after --"
    how = f"pass the entry script's own arguments after --: tierstore drill --entry {entry} ... -- ARGS"
    if refused:
        return f"the step function refused its arguments ({refused[-1]}; {given}): {how}"
    if isinstance(exc.code, str):
        return f"the step function exited: {one_line(exc.code)}"
    return f"the step function exited with status {exc.code} ({given})" + ("" if argv else f": {how}")
