"""A real S3 endpoint that misbehaves on purpose: moto's server behind a fault-injecting WSGI layer.

Faults are rules matched against each request (method, a substring of the path): answer with an HTTP
error (503 SlowDown, 500 InternalError) instead of serving it, serve it after a delay, or serve half
of its body and close the connection (a response cut short). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

from tests.http_faults import SHUTDOWN_POLL

_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error."),
    403: ("AccessDenied", "Access Denied"),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
}


@dataclass
class Rule:
    method: str | None
    path_contains: str
    times: int
    status: int = 0
    delay: float = 0.0
    cut: bool = False


class FaultInjector:
    """WSGI middleware; thread-safe rules, and a log of every request seen."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.rules: list[Rule] = []
        self.seen: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def fail(self, times: int, *, status: int = 503, method: str | None = None, path: str = "") -> None:
        """Answer the next ``times`` matching requests with ``status``."""
        with self.lock:
            self.rules.append(Rule(method, path, times, status=status))

    def slow(self, times: int, seconds: float, *, method: str | None = None, path: str = "") -> None:
        """Delay the next ``times`` matching requests by ``seconds``."""
        with self.lock:
            self.rules.append(Rule(method, path, times, delay=seconds))

    def cut(self, times: int, *, method: str | None = None, path: str = "") -> None:
        """Serve the next ``times`` matching requests with the full length announced but only half
        of the body sent, then close the connection."""
        with self.lock:
            self.rules.append(Rule(method, path, times, cut=True))

    def _match(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.seen.append((method, path))
            for rule in self.rules:
                if rule.times > 0 and rule.method in (None, method) and rule.path_contains in path:
                    rule.times -= 1
                    return rule
        return None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        rule = self._match(method, f"{path}?{query}")
        if rule is not None and rule.delay:
            time.sleep(rule.delay)
        if rule is not None and rule.status:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length)  # drain the body: keep-alive stays sane
            code, message = _ERRORS.get(rule.status, ("Error", "injected"))
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message><Condition>If-None-Match</Condition>"
                "<RequestId>fault</RequestId></Error>"
            ).encode()
            start_response(
                f"{rule.status} {code}",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        if rule is not None and rule.cut:
            return _cut_short(b"".join(self.app(environ, start_response)), environ)
        return self.app(environ, start_response)


def _cut_short(body: bytes, environ: dict[str, Any]) -> Iterator[bytes]:
    yield body[: len(body) // 2]
    # werkzeug would keep the connection open for the rest: close it, as a dropped server would.
    environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)


class FaultyS3(ThreadedMotoServer):
    """moto's threaded S3 server with a :class:`FaultInjector` in front."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = FaultInjector(DomainDispatcherApplication(create_backend_app))
        self.bucket = "faulty"

    def _server_entry(self) -> None:
        self._server = make_server(
            self._ip_address, self._port, self.faults, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever(poll_interval=SHUTDOWN_POLL)

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"
