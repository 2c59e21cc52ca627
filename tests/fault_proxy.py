"""A loopback TCP proxy that injects network faults between a client and an upstream server.

Put it in front of an S3 endpoint (moto, SeaweedFS) and point the client at :attr:`FaultProxy.endpoint`;
:meth:`FaultProxy.set_mode` then switches, from any thread, what every connection gets:

* ``"pass"``: bytes are forwarded both ways (the default).
* ``"refuse"``: nothing listens on the port any more, so connecting fails with ECONNREFUSED
  (boto3: ``EndpointConnectionError``). Switching away reopens the listener on the same port.
* ``"hang"``: connections are accepted and what the client sends is read and discarded, but
  nothing ever comes back and the proxy never hangs up (boto3: ``ReadTimeoutError``; a PUT takes
  1 s longer than the read timeout, as botocore first waits 1 s for a ``100 Continue``).
* ``"reset"``: connections are accepted and closed at once with a TCP RST (boto3:
  ``ConnectionClosedError``, or ``EndpointConnectionError`` when the RST lands while urllib3 is
  still setting up the connection).
* ``"503"``: every HTTP request is answered ``503 Slow Down`` with S3's XML error (code
  ``SlowDown``), without reaching the upstream. The connection is kept alive when the request's
  length is known (``Content-Length``); after ``Expect: 100-continue`` or a chunked body the proxy
  answers at once and closes the connection instead. (botocore sends every ``put_object`` and
  ``upload_part`` with ``Expect: 100-continue``, so those take a new connection each.)

A switch also cuts every connection the proxy holds (pass-through, hung or 503 ones), so a client
that pools keep-alive connections meets the new mode on its next request instead of reusing a
connection that still reaches the upstream. :attr:`FaultProxy.accepted` counts connections per
mode at the moment they were accepted, e.g. to assert that no request reached the upstream.

Plain threads and sockets, no third-party code: one thread accepts, one handles each connection
(plus one per pass-through connection for the upstream-to-client direction). Only the thread that
owns a socket closes it; others wake it with ``shutdown()``, so a descriptor is never closed under
a thread still using it (its number could meanwhile name another socket).
"""

from __future__ import annotations

import contextlib
import functools
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Literal, get_args

Mode = Literal["pass", "refuse", "hang", "reset", "503"]
"""What the proxy does with connections (see the module docstring)."""
MODES: tuple[Mode, ...] = get_args(Mode)

SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>fault-proxy</RequestId></Error>"
)
"""The body of each ``"503"`` answer: S3's throttling error."""

_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN
_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024  # longest request head (request line + headers) the 503 mode parses
_DRAIN_S = 2.0  # how long a closing 503 connection waits for the client to hang up


class FaultProxy:
    """A TCP proxy on ``127.0.0.1`` (port chosen by the kernel) in front of ``upstream_host:port``.

    ``with FaultProxy(host, port) as proxy: ...`` starts and stops it. ``connect_timeout`` bounds
    the connection to the upstream in ``"pass"`` mode; if it fails, the client's connection is
    reset, as if the upstream were down.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, connect_timeout: float = 5.0):
        self.upstream = (upstream_host, upstream_port)
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()  # guards the state below; never held while blocking
        self._switch = threading.Lock()  # serialises start/stop/set_mode (listener open and close)
        self._mode: Mode = "pass"
        self._port = 0
        self._listener: _Listener | None = None
        self._connections: set[_Connection] = set()
        self._threads: set[threading.Thread] = set()
        self._accepted = dict.fromkeys(MODES, 0)
        self._running = False

    @property
    def port(self) -> int:
        """The port the proxy listens on (0 before :meth:`start`); it stays the same until stop."""
        return self._port

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``: the URL to give the client instead of the upstream's."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def mode(self) -> Mode:
        """The current mode."""
        return self._mode

    @property
    def accepted(self) -> dict[Mode, int]:
        """How many connections were accepted in each mode so far (a snapshot)."""
        with self._lock:
            return dict(self._accepted)

    def start(self) -> FaultProxy:
        """Bind the port and start accepting (unless the mode is already ``"refuse"``)."""
        with self._switch:
            if self._running:
                raise RuntimeError("the proxy is already running")
            # Bind even in "refuse" mode: the port number must be known (and kept) from now on.
            self._open_listener()
            self._running = True
            if self._mode == "refuse":
                self._close_listener()
        return self

    def stop(self) -> None:
        """Stop listening, cut every connection and wait for the proxy's threads. Idempotent."""
        with self._switch:
            if not self._running:
                return
            self._running = False
            self._close_listener()
            with self._lock:
                victims = list(self._connections)
                threads = list(self._threads)
            for connection in victims:
                connection.interrupt()
        for thread in threads:
            thread.join(timeout=10)

    def set_mode(self, mode: Mode) -> None:
        """Switch to ``mode``: new connections get it at once, existing ones are cut.

        Raises ``ValueError`` for an unknown mode, ``OSError`` if the port cannot be bound again
        when leaving ``"refuse"`` (another process took it meanwhile).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        with self._switch:
            with self._lock:
                previous, self._mode = self._mode, mode
                victims = list(self._connections) if mode != previous else []
            if not self._running or mode == previous:
                return
            if mode == "refuse":
                self._close_listener()  # returns once the port refuses connections
            elif previous == "refuse":
                self._open_listener()
            for connection in victims:
                connection.interrupt()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # Listener (called with self._switch held).

    def _open_listener(self) -> None:
        sock = _bind("127.0.0.1", self._port)
        self._port = sock.getsockname()[1]
        listener = _Listener(sock)
        with self._lock:
            self._listener = listener
        listener.thread = self._spawn(lambda: self._accept_loop(listener), "accept")

    def _close_listener(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    # Threads.

    def _spawn(self, target: Callable[[], None], role: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, name=f"fault-proxy-{self._port}-{role}", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def _accept_loop(self, listener: _Listener) -> None:
        try:
            while (client := listener.accept()) is not None:
                connection = None
                with self._lock:
                    # Mode and registration under one lock: a switch either precedes this
                    # connection (which then gets the new mode) or sees it and cuts it.
                    mode = self._mode
                    if self._listener is listener:  # else: closed while this one was accepted
                        self._accepted[mode] += 1
                        if mode != "reset":
                            connection = _Connection(client)
                            self._connections.add(connection)
                if connection is None:
                    _close_with_rst(client)
                    continue
                self._spawn(functools.partial(self._serve, connection, mode), mode)
        finally:
            listener.release()  # this thread owns the listening socket

    def _serve(self, connection: _Connection, mode: Mode) -> None:
        try:
            if mode == "pass":
                self._forward(connection)
            elif mode == "hang":
                _hang(connection)
            elif mode == "503":
                _slow_down(connection)
            else:  # "refuse" and "reset" connections are never handed to a thread
                raise AssertionError(mode)
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _forward(self, connection: _Connection) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=self.connect_timeout)
        except OSError:
            connection.interrupt()  # the upstream is down: so is the proxied connection
            return
        upstream.settimeout(None)
        _no_delay(upstream)
        _no_delay(connection.client)
        if not connection.attach(upstream):
            return  # cut while connecting (attach closed it)
        back = self._spawn(lambda: _pump(connection, upstream, connection.client), "back")
        _pump(connection, connection.client, upstream)
        back.join()


class _Listener:
    """A listening socket, its accept thread and the socket pair that wakes that thread to stop.

    Closing a socket does not wake a thread blocked in ``accept()`` on it (Linux), hence the wake-up
    pair and a selector (``select()`` would fail on descriptors above 1023).
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(False)  # a connection may vanish between the wake-up and accept()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self.thread: threading.Thread | None = None

    def accept(self) -> socket.socket | None:
        """The next client connection, or None once :meth:`close` was called."""
        try:
            while True:
                ready = {key.fileobj for key, _ in self._selector.select()}
                if self._wake_r in ready:
                    return None
                try:
                    client, _ = self.sock.accept()
                except (BlockingIOError, ConnectionAbortedError):
                    continue
                client.setblocking(True)
                return client
        except OSError:  # the listening socket failed: stop accepting
            return None

    def release(self) -> None:
        """Close the listening socket (by the accept thread, when it stops)."""
        self._selector.close()
        self.sock.close()

    def close(self) -> None:
        """Stop the accept thread and wait until it has closed the listening socket."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self.thread is not None:
            self.thread.join()
        else:  # never started: nobody else will close it
            self.release()
        self._wake_r.close()
        self._wake_w.close()


class _Connection:
    """One accepted client connection and, in ``"pass"`` mode, its upstream connection."""

    def __init__(self, client: socket.socket):
        self.client = client
        self.upstream: socket.socket | None = None
        self.cut = threading.Event()
        # Makes interrupt() and close() exclusive: shutting down a descriptor number that close()
        # just released could hit an unrelated socket that reused it.
        self._lock = threading.Lock()
        self._closed = False

    def _sockets(self) -> list[socket.socket]:
        return [s for s in (self.client, self.upstream) if s is not None]

    def attach(self, upstream: socket.socket) -> bool:
        """Adopt the upstream socket; False (and closed) if the connection was cut meanwhile."""
        with self._lock:
            if not self.cut.is_set():
                self.upstream = upstream
                return True
        upstream.close()
        return False

    def interrupt(self) -> None:
        """Cut the connection from any thread: RST on close, and wake every thread blocked on it."""
        with self._lock:
            self.cut.set()
            if self._closed:
                return
            for sock in self._sockets():
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                with contextlib.suppress(OSError):  # not connected: the peer has gone already
                    sock.shutdown(socket.SHUT_RDWR)  # wakes recv() and send(); close() would not

    def close(self) -> None:
        """Close both sockets (only the connection's own thread calls this, when done with them)."""
        with self._lock:
            self._closed = True
            for sock in self._sockets():
                sock.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Reopening the same port after "refuse": connections to the old listener may sit in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _no_delay(sock: socket.socket) -> None:
    # Small HTTP heads and answers would otherwise wait on Nagle's algorithm plus delayed ACKs.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _close_with_rst(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    sock.close()


def _pump(connection: _Connection, source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until EOF (passed on as a half-close) or an error (cuts both)."""
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        connection.interrupt()


def _hang(connection: _Connection) -> None:
    """Read and discard until the client is done, then hold the connection open until cut."""
    with contextlib.suppress(OSError):
        while connection.client.recv(_CHUNK):
            pass
    connection.cut.wait()


class _Reader:
    """Buffered reads of an HTTP request stream."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        self.buffer += data
        return bool(data)

    def head(self) -> bytes | None:
        """The next request line and headers, or None at EOF (or if they exceed the limit)."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD or not self._fill():
                return None
        head = bytes(self.buffer[:end])
        del self.buffer[: end + 4]
        return head

    def skip(self, count: int) -> bool:
        """Consume ``count`` bytes of body; False at EOF."""
        while count > 0:
            if not self.buffer and not self._fill():
                return False
            taken = min(count, len(self.buffer))
            del self.buffer[:taken]
            count -= taken
        return True


def _slow_down(connection: _Connection) -> None:
    """Answer every request on the connection with 503 SlowDown (see the module docstring)."""
    sock = connection.client
    reader = _Reader(sock)
    try:
        while (head := reader.head()) is not None:
            method, headers = _parse_head(head)
            length = int(headers.get("content-length", "0") or "0")
            # Body of unknown extent, or one the client only sends after a "100 Continue" it will
            # not get: answer now, then close, since the next request's start cannot be found.
            keep_alive = (
                "chunked" not in headers.get("transfer-encoding", "").lower()
                and "100-continue" not in headers.get("expect", "").lower()
                and "close" not in headers.get("connection", "").lower()
            )
            if keep_alive and not reader.skip(length):
                return
            sock.sendall(_slow_down_answer(method, keep_alive))
            if not keep_alive:
                _drain_and_close(sock)
                return
    except (OSError, ValueError):  # connection cut, or a request we cannot parse
        return


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    request_line, *lines = head.decode("latin-1").split("\r\n")
    method = request_line.split(" ", 1)[0].upper()
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, headers


def _slow_down_answer(method: str, keep_alive: bool) -> bytes:
    head = (
        "HTTP/1.1 503 Slow Down\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(SLOW_DOWN_BODY)}\r\n"
        "x-amz-request-id: fault-proxy\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n"
        "\r\n"
    ).encode("ascii")
    return head if method == "HEAD" else head + SLOW_DOWN_BODY  # HEAD answers carry no body


def _drain_and_close(sock: socket.socket) -> None:
    # Closing with unread request bytes pending would send RST, which can destroy the answer before
    # the client reads it: send FIN, then read until the client hangs up (or a short timeout).
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(_DRAIN_S)
    with contextlib.suppress(OSError):
        while sock.recv(_CHUNK):
            pass
