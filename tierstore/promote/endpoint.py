"""The promoter's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz`` (probes).

One small threaded WSGI server, as ``prometheus_client.start_http_server`` runs, with two more paths.
The probes answer ``200`` or ``503`` with a one-line plain-text reason (see
:mod:`tierstore.promote.health`); every other path is Prometheus's exposition, as before.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from tierstore.promote.health import PromoterHealth, Verdict

StartResponse = Callable[..., Any]


class _QuietHandler(WSGIRequestHandler):
    """No access log: probes every few seconds would drown the promoter's events."""

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing."""


def health_app(
    registry: CollectorRegistry, health: PromoterHealth | None
) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """A WSGI app: probes at ``/healthz`` and ``/readyz`` (when ``health`` is given), else metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if health is not None and path in ("/healthz", "/readyz"):
            verdict: Verdict = health.liveness() if path == "/healthz" else health.readiness()
            body = (verdict.reason + "\n").encode()
            status = "200 OK" if verdict.ok else "503 Service Unavailable"
            start_response(
                status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
            )
            return [body]
        result: Iterable[bytes] = metrics(environ, start_response)
        return result

    return app


def serve(
    registry: CollectorRegistry, health: PromoterHealth | None, port: int, addr: str = "127.0.0.1"
) -> WSGIServer:
    """Serve on ``addr:port`` (port 0 picks a free one) from a daemon thread; return the server
    (``server.server_port`` is the port, ``server.shutdown()`` stops it). Raises :class:`OSError`
    when the address cannot be bound."""
    family, _type, _proto, _name, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family  # an IPv6 address (e.g. "::") needs an AF_INET6 socket

    server: WSGIServer = make_server(
        str(sockaddr[0]), port, health_app(registry, health), Server, handler_class=_QuietHandler
    )
    # The loop looks for shutdown() every 0.1 s (the standard 0.5 s held each stop that long).
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="tierstore-http", daemon=True)
    thread.start()
    return server
