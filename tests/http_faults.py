"""A loopback HTTP proxy that injects S3 faults into a random share of requests, drawn from a seed.

Where :mod:`tests.fault_proxy` switches every connection between a healthy and a broken upstream
(an outage), this proxy reads each HTTP request and its answer and breaks a share of them, the way a
busy or flaky store does: ``with HttpFaultProxy(host, port, rate=0.2, seed=7) as proxy`` and point
the client at :attr:`HttpFaultProxy.endpoint`. The faults (:data:`FAULTS`):

* ``"503"``: answered ``503 Slow Down`` (S3's ``SlowDown`` XML) without reaching the store.
* ``"500"``: forwarded, so the store *did* the work, then answered ``500 InternalError``: the
  client must cope with a retried request that finds its first attempt done.
* ``"reset"``: forwarded, then the answer's head and half its body are sent and the connection
  is reset (TCP RST): a connection reset mid-body.
* ``"truncate"``: forwarded, then the answer is sent with its ``Content-Length`` but only half
  its body, and the connection closed (FIN): a truncated body. GET answers only (others have none).
* ``"slow"``: forwarded, then nothing is sent back for :attr:`HttpFaultProxy.slow_s` seconds
  (set it above the client's read timeout) before the connection is closed.
* ``"flip_request"``: one byte of an object upload's body (a ``PUT`` with a body) is flipped on
  its way to the store, which must refuse it by its checksum (``BadDigest``).
* ``"flip_response"``: one byte of a whole object's body (a ``GET`` of a key, no ``Range``) is
  flipped on its way back; the client must notice by the checksum the store sends with it.
* ``"flip_range"``: the same in a ranged ``GET`` (a part of an object), for which S3 sends no
  checksum: only a reader that checks the bytes it loads can notice. Not among :data:`FAULTS`.

A request is broken with probability ``rate``, by one of the faults that apply to it, each drawn
from one ``random.Random(seed)`` in the order the requests arrive: concurrent requests may take
the draws in another order from run to run, but the rate and the mix are the seed's. Flips apply
to object bodies only: S3's XML control messages (listings, upload ids) carry no checksum on plain
HTTP, where TLS protects them in production. :attr:`HttpFaultProxy.injected` counts each fault,
:attr:`HttpFaultProxy.requests` every request, :attr:`HttpFaultProxy.seen` requests by method and
object.

Plain threads, sockets and :mod:`http.client`, no third-party code: one thread per client
connection, each with its own keep-alive connection to the store.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import socketserver
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler
from typing import Literal, get_args
from urllib.parse import urlsplit

SHUTDOWN_POLL = 0.05
"""How often a test server's loop looks for ``shutdown()`` (the standard library's 0.5 s made each
test with its own server half a second longer)."""

Fault = Literal["503", "500", "reset", "truncate", "slow", "flip_request", "flip_response", "flip_range"]
"""A way to break one request (see the module docstring)."""
FAULTS: tuple[Fault, ...] = tuple(f for f in get_args(Fault) if f != "flip_range")
"""The faults drawn unless others are asked for: every one but ``"flip_range"``."""

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "expect", "te", "trailer", "upgrade"}
)
_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def error_body(code: str, message: str) -> bytes:
    """S3's XML error document."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>http-faults</RequestId></Error>"
    ).encode()


class HttpFaultProxy:
    """An HTTP proxy on ``127.0.0.1`` (port chosen by the kernel) in front of ``host:port``.

    ``rate`` (0 to 1), ``faults`` and ``seed`` may be changed with :meth:`configure` while it runs;
    ``slow_s`` is how long a ``"slow"`` answer is held back.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        rate: float = 0.0,
        faults: Sequence[Fault] = FAULTS,
        seed: int = 0,
        only: Callable[[str, str], bool] | None = None,
        slow_s: float = 3.0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.slow_s = slow_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.injected: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        """Requests by ``"METHOD /bucket/key"`` (no query), broken or not."""
        self.rate, self.faults, self.only = 0.0, tuple(faults), only
        self._random = random.Random(seed)  # noqa: S311 - fault draws, not cryptography
        self.configure(rate=rate, faults=faults, seed=seed, only=only)

    def configure(
        self,
        *,
        rate: float,
        faults: Sequence[Fault] = FAULTS,
        seed: int | None = None,
        only: Callable[[str, str], bool] | None = None,
    ) -> None:
        """Break ``rate`` of the requests from now on, by ``faults``; only those for which
        ``only(method, path)`` is true, if given (a store that lists but takes no writes under
        one prefix, say). A new ``seed`` restarts the draws. Raises ``ValueError`` for a rate
        outside 0..1 or an unknown fault."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate {rate} is not between 0 and 1")
        unknown = set(faults) - set(get_args(Fault))
        if unknown or not faults:
            raise ValueError(f"unknown faults {sorted(unknown)} (or none): {get_args(Fault)}")
        with self._lock:
            self.rate, self.faults, self.only = rate, tuple(faults), only
            if seed is not None:
                self._random = random.Random(seed)  # noqa: S311 - not cryptography

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``: the URL to give the client instead of the store's."""
        assert self._server is not None, "start the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HttpFaultProxy:
        """Listen and serve on a background thread."""
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL,), name="http-faults", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, cut every connection (held ``"slow"`` ones too). Idempotent."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.cut_all()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HttpFaultProxy:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def draw(self, method: str, path: str, body: bytes, *, ranged: bool = False) -> Fault | None:
        """The fault for this request, or None; counted."""
        with self._lock:
            self.requests += 1
            self.seen[f"{method} {urlsplit(path).path}"] += 1
            if self.only is not None and not self.only(method, path):
                return None
            if self._random.random() >= self.rate:
                return None
            fitting = [f for f in self.faults if _applies(f, method, path, body, ranged)]
            if not fitting:
                return None
            fault = self._random.choice(fitting)
            self.injected[fault] += 1
            return fault

    def hold(self) -> None:
        """Wait ``slow_s`` seconds (less if the proxy stops meanwhile)."""
        self._stopping.wait(self.slow_s)

    def flip_position(self, size: int) -> int:
        """Which byte of a ``size``-byte body to flip (from the same seeded draws)."""
        with self._lock:
            return self._random.randrange(size)


def _is_object(path: str) -> bool:
    """A request about one object's bytes: ``/bucket/key`` with no sub-resource query."""
    parts = urlsplit(path)
    return parts.path.strip("/").count("/") >= 1 and not parts.query


def _applies(fault: Fault, method: str, path: str, body: bytes, ranged: bool) -> bool:
    if fault == "truncate":
        return method == "GET"
    if fault == "flip_request":  # an object upload or one of its parts
        return method == "PUT" and bool(body) and urlsplit(path).path.strip("/").count("/") >= 1
    if fault in ("flip_response", "flip_range"):
        return method == "GET" and _is_object(path) and ranged == (fault == "flip_range")
    return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, proxy: HttpFaultProxy) -> None:
        self.proxy = proxy
        self.live: set[socket.socket] = set()
        self.live_lock = threading.Lock()
        super().__init__(address, handler)

    def cut_all(self) -> None:
        with self.live_lock:
            for sock in self.live:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    """One client connection: every request on it is forwarded (or broken) in turn."""

    protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for botocore's uploads
    timeout = 60  # an idle keep-alive connection is closed after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.live_lock:
            self.server.live.add(self.connection)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        with self.server.live_lock:
            self.server.live.discard(self.connection)
        if self._upstream is not None:
            self._upstream.close()
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the client's errors tell what happened."""

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._body()
        fault = proxy.draw(self.command, self.path, body, ranged="Range" in self.headers)
        if fault == "503":
            self._answer(503, "Slow Down", error_body("SlowDown", "Please reduce your request rate."))
            return
        if fault == "flip_request":
            body = _flipped(body, proxy.flip_position(len(body)))
        status, reason, headers, answer = self._forward(body)
        if fault == "500":
            self._answer(500, "Internal Server Error", error_body("InternalError", "injected"))
        elif fault == "slow":
            proxy.hold()  # the client gives up first (its read timeout)
            self.close_connection = True
        elif fault == "reset":  # mid-body; an answer without a body is cut before its head
            if answer:
                self._send_head(status, reason, headers, len(answer))
                self.wfile.write(answer[: len(answer) // 2])
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
            self.close_connection = True
        elif fault == "truncate":
            self._send_head(status, reason, headers, len(answer))
            self.wfile.write(answer[: len(answer) // 2])
            self.close_connection = True
        else:
            if fault in ("flip_response", "flip_range") and answer:
                answer = _flipped(answer, proxy.flip_position(len(answer)))
            self._send_head(status, reason, headers, len(answer))
            if self.command != "HEAD":
                self.wfile.write(answer)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815 - the base's names

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request to the store (reconnecting once if a kept-alive connection died)."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        for attempt in (1, 2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=60)
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                response = self._upstream.getresponse()
                answer = response.read()
            except (OSError, http.client.HTTPException):
                self._upstream.close()
                self._upstream = None
                if attempt == 2:
                    raise
                continue
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            if response.will_close:
                self._upstream.close()
                self._upstream = None
            return response.status, response.reason, kept, answer
        raise AssertionError("unreachable")

    def _send_head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() != "content-length" or self.command == "HEAD":
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _answer(self, status: int, reason: str, body: bytes) -> None:
        self._send_head(status, reason, [("Content-Type", "application/xml")], len(body))
        if self.command != "HEAD":
            self.wfile.write(body)


def _flipped(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x01
    return bytes(changed)
