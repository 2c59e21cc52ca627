"""Count what tierstore asks of its tiers, from outside tierstore: S3 requests and file operations.

* :class:`CountingS3` is moto's S3 server on ``127.0.0.1`` (port 0) behind a WSGI layer of our own
  that counts every HTTP request it answers, by S3 operation (``GET list``, ``PUT object`` …). It
  sees what the server sees, whichever client sent it (botocore, s3fs's aiobotocore).
* :class:`FileOps` counts the file operations Python's audit hooks report below some directories:
  opens, directory listings (``listdir``, ``scandir``), renames, links, removals, ``mkdir``/``rmdir``.
  ``os.stat`` raises no audit event (CPython 3.11), so stats are not counted: time them instead.

Neither patches tierstore: the code under measurement runs unchanged.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from tests.http_faults import SHUTDOWN_POLL

_FILE_EVENTS = frozenset(
    {"open", "os.listdir", "os.scandir", "os.rename", "os.link", "os.remove", "os.mkdir", "os.rmdir"}
)

_PLACEHOLDERS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def s3_operation(environ: dict[str, Any]) -> str:
    """A short name of the S3 operation a request asks for (``GET list``, ``PUT object``, …)."""
    method = str(environ.get("REQUEST_METHOD", "?"))
    query = str(environ.get("QUERY_STRING", ""))
    path = str(environ.get("PATH_INFO", "/")).strip("/")
    if "uploads" in query or "uploadId" in query:
        return f"{method} multipart"
    if "/" not in path:  # the bucket itself: listings, bucket calls
        return f"{method} list" if method == "GET" else f"{method} bucket"
    return f"{method} object"


_RECORDS = (  # the first of these names found in a request's key (or listed prefix) is its record
    ("/.tierstore/keeper/", "lease"),
    ("/.tierstore/index.json", "index"),
    ("/.tierstore/changes", "stamp"),
    ("/.tierstore/head", "head"),
    ("/.tierstore/commits/", "log"),
    ("/.tierstore/seen/", "sightings"),
    ("/.tierstore/activity/", "activity"),
    ("/.tierstore/", "other record"),
    ("/commit.json", "marker"),
)


def s3_record(environ: dict[str, Any]) -> str:
    """Which of tierstore's records a request is about (``lease``, ``index``, ``stamp``, ``marker``
    …; ``data`` for anything else), from its key, or for a listing from the prefix it lists."""
    path = str(environ.get("PATH_INFO", "/"))
    query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")))
    prefix = query.get("prefix", [""])[0]
    key = f"{path}/{prefix}" if prefix else path
    return next((name for part, name in _RECORDS if part in key), "data")


class CountingS3:
    """moto's S3 server on loopback, counting the requests it answers. A context manager.

    ``with CountingS3() as s3: ...`` gives :attr:`endpoint`; :meth:`counting` counts the requests
    of one block of code. Its backend is reachable for bulk set-up (:meth:`put_direct`).
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.keys: collections.Counter[str] = collections.Counter()
        """Requests by method and path (``GET /bucket/key``)."""
        self.records: collections.Counter[str] = collections.Counter()
        """Requests by operation and record: ``GET object lease``, ``GET list marker`` …"""
        self._lock = threading.Lock()
        self.endpoint = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CountingS3:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        for key, value in _PLACEHOLDERS.items():  # the server accepts any credentials
            os.environ.setdefault(key, value)
        app = DomainDispatcherApplication(create_backend_app)

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            operation, record = s3_operation(environ), s3_record(environ)
            with self._lock:
                self.counts[operation] += 1
                self.keys[f"{environ.get('REQUEST_METHOD', '?')} {environ.get('PATH_INFO', '/')}"] += 1
                self.records[f"{operation} {record}"] += 1
            return app(environ, start_response)  # type: ignore[no-any-return]

        self._server = make_server("127.0.0.1", 0, counted, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL,), daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        assert self._thread is not None
        self._thread.join()

    def total(self) -> int:
        """Requests answered so far."""
        with self._lock:
            return sum(self.counts.values())

    def counting(self, *, by_key: bool = False) -> _Window:
        """``with s3.counting() as seen: ...``; then ``seen.total`` and ``seen.by_operation`` (with
        ``by_key``: by method and path, ``GET /bucket/key``)."""
        counts = self.keys if by_key else self.counts
        return _Window(counts, self._lock, lambda _on: None)  # the server counts always

    def counting_records(self) -> _Window:
        """:meth:`counting` by operation and record (:func:`s3_record`): ``GET object index`` …"""
        return _Window(self.records, self._lock, lambda _on: None)

    @staticmethod
    def put_direct(bucket: str, items: Iterable[tuple[str, bytes]]) -> None:
        """Store objects straight into moto's backend, without HTTP: a cheap set-up of many
        objects (what a real S3 then lists and serves is the same)."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        for key, data in items:
            backend.put_object(bucket, key, data)


class _Window:
    """What a counter counted inside one ``with`` block (``switch`` turns its counting on/off)."""

    def __init__(
        self, counts: collections.Counter[str], lock: threading.Lock, switch: Callable[[bool], None]
    ) -> None:
        self.counts, self.lock, self.switch = counts, lock, switch
        self.by_operation: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> _Window:
        with self.lock:
            self._start = collections.Counter(self.counts)
        self.switch(True)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.switch(False)
        with self.lock:
            self.by_operation = self.counts - self._start

    @property
    def total(self) -> int:
        """What was counted inside the block."""
        return sum(self.by_operation.values())


class FileOps:
    """Counts audited file operations on paths below ``roots`` while a :meth:`window` is open.

    One audit hook per process (Python cannot remove one): make one instance and reuse it.
    """

    def __init__(self, roots: Iterable[str] = ()) -> None:
        self.roots: tuple[str, ...] = tuple(str(r) for r in roots)
        self.counts: collections.Counter[str] = collections.Counter()
        self._on = False
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self._on or event not in _FILE_EVENTS or not args:
            return
        path = args[0]
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        if isinstance(path, str) and path.startswith(self.roots):
            with self._lock:
                self.counts[event] += 1

    def window(self) -> _Window:
        """``with ops.window() as seen: ...``; then ``seen.total`` and ``seen.by_operation``."""
        return _Window(self.counts, self._lock, self._switch)

    def _switch(self, on: bool) -> None:
        self._on = on
