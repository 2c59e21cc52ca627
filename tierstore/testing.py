"""Helpers for tests, the demo and the benchmark: an embedded S3 endpoint on loopback.

Needs the ``dev`` extra (moto with its server). Never used on the data path of real jobs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator


def _placeholder_credentials() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@contextlib.contextmanager
def embedded_s3(*, own_process: bool = False) -> Iterator[str]:
    """Start moto's S3 server on ``127.0.0.1`` with a free port; yield its endpoint URL.

    ``own_process``: run the server in a child process, as a real S3 is another machine. In this
    process its request handling shares the interpreter lock with the client under test, so every
    client cycle also slows the server (the benchmark compares clients; tests need no such care).
    Sets placeholder AWS credentials in the environment if none are set (the server accepts any).
    Raises ``RuntimeError`` if the child process does not start its server.
    """
    _placeholder_credentials()
    if own_process:
        with _server_process() as endpoint:
            yield endpoint
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@contextlib.contextmanager
def _server_process() -> Iterator[str]:
    command = [sys.executable, "-c", "from tierstore.testing import serve_s3; serve_s3()"]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the S3 server process did not start (exit {child.poll()})")
        yield endpoint
    finally:
        child.stdin.close()  # the child stops its server when its stdin ends
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def serve_s3() -> None:
    """Run moto's S3 server on ``127.0.0.1`` (free port) until stdin ends; print its endpoint."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    print(f"http://{host}:{port}", flush=True)
    sys.stdin.read()
    server.stop()
