"""Shared fixtures: tier roots under a temp dir, and a real S3 endpoint (moto's server on loopback).

S3 is always moto's ``ThreadedMotoServer`` on ``127.0.0.1`` with port 0, reached over HTTP by s3fs and
boto3 exactly as a real store would be; each test gets its own bucket.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.request_counter import CountingS3, FileOps
from tests.tiers import dict_tier  # noqa: F401 - registers the tests' own "dict" tier type
from tierstore.testing import embedded_s3

pytest_plugins = [
    "tests.lanes",  # test lanes: markers applied at collection, and the quick lane's guard
    "tests.s3server",  # the real S3 server (SeaweedFS), started once per session when a test asks
]

# Fake credentials for the local moto server only; set before any client is created.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


@pytest.fixture(autouse=True)
def own_tier_verdicts(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's processes share tier verdicts among themselves only
    (:mod:`tierstore._platform.node_verdicts`): a port or path reused by a later test must not
    inherit an earlier test's "unreachable"."""
    monkeypatch.setenv("TIERSTORE_HEALTH_DIR", str(tmp_path_factory.mktemp("verdicts")))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server started for this test session."""
    with embedded_s3() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def counted_s3() -> Iterator[CountingS3]:
    """moto's S3 server counting the requests it answers (:mod:`tests.request_counter`), one per
    test module."""
    with CountingS3() as s3:
        yield s3


@pytest.fixture(scope="module")
def file_ops() -> FileOps:
    """The file operations below some roots, counted (one audit hook per module)."""
    return FileOps()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the session's moto server."""
    import boto3

    name = f"ts-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_client(s3_endpoint: str) -> Any:
    """A boto3 client on the moto server (for assertions behind tierstore's back)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint)


TierSpec = dict[str, Any]


@pytest.fixture
def tier_specs(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., list[TierSpec]]:
    """Build YAML-ready tier entries: ``tier_specs("memory", "local", "s3", **overrides)``."""

    def build(*kinds: str, **extra: Any) -> list[TierSpec]:
        specs: list[TierSpec] = []
        for index, kind in enumerate(kinds):
            name = f"{kind}{index}" if kinds.count(kind) > 1 else kind
            if kind == "dict":  # the tests' own tier type (tests/tiers/dict_tier.py)
                spec: TierSpec = {"name": name, "type": "dict", "store": f"{tmp_path}/{name}"}
            elif kind == "s3":
                bucket = request.getfixturevalue("s3_bucket")
                endpoint = request.getfixturevalue("s3_endpoint")
                spec = {
                    "name": name,
                    "type": "s3",
                    "url": f"s3://{bucket}/ckpt",
                    "endpoint_url": endpoint,
                    "max_attempts": 3,
                    "part_size": "5MiB",
                }
            else:
                node = "/{node}" if kind in ("memory", "local") else ""
                spec = {"name": name, "type": kind, "path": str(tmp_path / f"{name}{node}")}
            spec.update(extra.get(name, {}))
            specs.append(spec)
        return specs

    return build


@pytest.fixture
def make_config(tier_specs: Callable[..., list[TierSpec]]) -> Callable[..., Any]:
    """``make_config("memory", "s3", namespace="run1", verify_on_load=True)`` -> a Config."""
    from tierstore.config import config_from_dict

    def build(*kinds: str, tiers: dict[str, Any] | None = None, **top: Any) -> Any:
        data = {"tiers": tier_specs(*kinds, **(tiers or {})), **top}
        return config_from_dict(data)

    return build


def open_uploads(tier: Any) -> list[str]:
    """Paths of every incomplete write the tier reports, however recent (for assertions)."""
    return [w.path for w in tier.incomplete_writes(idle_for=0.0, now=float("inf"))]


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount_tmpfs("8m")``: a real, small tmpfs mounted for this test (root only, else a skip)."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_tmpfs(mount_tmpfs: Callable[[str], Path]) -> Path:
    """A 1 MiB tmpfs: a memory or middle tier that fills up (real ENOSPC)."""
    return mount_tmpfs("1m")


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory of its own off any tmpfs (``make quick`` puts ``tmp_path`` on one, where an
    fsync costs nothing), removed after; a skip where the system's temp directory is a tmpfs."""
    from tierstore._platform.mapping import is_tmpfs

    if is_tmpfs(tempfile.gettempdir()):
        pytest.skip("the system's temporary directory is a tmpfs here")
    where = Path(tempfile.mkdtemp(prefix="tierstore-disk-"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of its own on the tmpfs at ``/dev/shm`` (where a mirror's spares are mapped),
    removed after; a skip where ``/dev/shm`` is no tmpfs."""
    from tierstore._platform.mapping import is_tmpfs

    if not os.path.isdir("/dev/shm") or not is_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm: spares are mapped only on a tmpfs")
    where = Path(tempfile.mkdtemp(prefix="tierstore-shm-", dir="/dev/shm"))
    yield where
    shutil.rmtree(where, ignore_errors=True)
