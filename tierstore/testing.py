"""Helpers for tests, the demo and the benchmark: an embedded S3 endpoint on loopback.

Needs the ``dev`` extra (moto with its server). Never used on the data path of real jobs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def embedded_s3() -> Iterator[str]:
    """Start moto's S3 server on ``127.0.0.1`` with a free port; yield its endpoint URL.

    Sets placeholder AWS credentials in the environment if none are set (the server accepts any).
    """
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
