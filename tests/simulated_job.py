"""A simulated job for measuring costs: many committed checkpoints of many ranks' files in four
tiers, set up in one process in the tiers' own layout.

Each checkpoint is what a committed save leaves in a tier: one data file per rank, DCP's metadata,
the marker (:class:`~tierstore.records.marker.Manifest`, as the protocol writes it) and the commit-log
entry; and in each tier the log's head record the protocol keeps. POSIX tiers get plain files; the
S3 tier's objects go straight into moto's backend
(:meth:`tests.request_counter.CountingS3.put_direct`): no HTTP, so 10,000 checkpoints take seconds.
What tierstore then lists and reads is the same as after real saves and promotions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.request_counter import CountingS3, FileOps
from tierstore.checksum import crc32c
from tierstore.config import Config, config_from_dict
from tierstore.ids import HEAD_PATH, commit_entry_path, data_file, marker_path, metadata_file
from tierstore.records.log import Head
from tierstore.records.marker import FileEntry, Manifest

BLOB = b"x" * 64
"""The content of every simulated file: the costs measured here are per request, not per byte."""


def manifest_for(index: int, ranks: int, namespace: str, *, seq: int | None = None) -> Manifest:
    """Checkpoint ``index``'s marker: one data file per rank, DCP's metadata, commit number ``seq``
    (default ``index``), in a generation of that number (another ``seq``: an overwrite's)."""
    seq = index if seq is None else seq
    generation = f"g{seq:011x}00000000"
    crc = crc32c(BLOB)
    files = [FileEntry(data_file(generation, r, 0), len(BLOB), crc, r, 0) for r in range(ranks)]
    files.append(FileEntry(metadata_file(generation), len(BLOB), crc, None, 0))
    return Manifest(f"step_{index * 100:08d}", generation, ranks, tuple(files), seq=seq, namespace=namespace)


def layout(manifest: Manifest) -> Iterator[tuple[str, bytes]]:
    """Every tier-relative path a committed copy consists of, with its bytes."""
    for entry in manifest.files:
        yield f"{manifest.checkpoint_id}/{entry.path}", BLOB
    yield marker_path(manifest.checkpoint_id), manifest.to_json()
    yield commit_entry_path(manifest.seq or 0, manifest.checkpoint_id, manifest.generation), b""


class Job:
    """Four tiers of one simulated job, and the counters that watch them."""

    def __init__(
        self, s3: CountingS3, ops: FileOps, root: Path, namespace: str, *, endpoint: str = ""
    ) -> None:
        """``endpoint``: another S3 server for the S3 tier (a real one, to time it); its objects
        are then uploaded (16 at a time), and its requests are not counted."""
        import boto3

        self.s3, self.ops, self.namespace = s3, ops, namespace
        self.endpoint = endpoint or s3.endpoint
        self.bucket = f"costs-{namespace}"
        self.client = boto3.client("s3", endpoint_url=self.endpoint)
        self.client.create_bucket(Bucket=self.bucket)
        self.roots = {name: root / namespace / name for name in ("ram", "nvme", "pfs")}
        ops.roots = tuple(str(r) for r in self.roots.values())
        self.config: Config = config_from_dict(
            {
                "namespace": namespace,
                # sightings stay trusted for the whole run, and the keeper's lease renewals (their
                # own cost: a HEAD, a GET and a PUT a third of a lease) fall outside what is counted
                "promote": {"interval": "1h", "keeper_lease": "1h"},
                "probe_timeout": "1h",  # a slow listing is measured, not cut short
                "tiers": [
                    {"name": "ram", "type": "memory", "path": str(self.roots["ram"])},
                    {"name": "nvme", "type": "local", "path": str(self.roots["nvme"])},
                    {"name": "pfs", "type": "shared", "path": str(self.roots["pfs"])},
                    {
                        "name": "s3",
                        "type": "s3",
                        "url": f"s3://{self.bucket}/ts",
                        "endpoint_url": self.endpoint,
                    },
                ],
            }
        )

    def populate(self, count: int, ranks: int) -> None:
        """``count`` committed checkpoints of ``ranks`` files each, in every tier (set-up only)."""
        for index in range(1, count + 2):
            items = (
                list(layout(manifest_for(index, ranks, self.namespace)))
                if index <= count
                else [(HEAD_PATH, Head(count, logged=True).encode())]
            )
            for root in self.roots.values():
                for rel, data in items:
                    path = root / self.namespace / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
            objects = [(f"ts/{self.namespace}/{k}", v) for k, v in items]
            if self.endpoint == self.s3.endpoint:
                self.s3.put_direct(self.bucket, objects)
            else:
                with ThreadPoolExecutor(16) as pool:
                    list(
                        pool.map(
                            lambda o: self.client.put_object(Bucket=self.bucket, Key=o[0], Body=o[1]), objects
                        )
                    )

    def measure(self, what: Callable[[], object]) -> dict[str, Any]:
        """Run ``what`` once: its S3 requests (by operation), file operations and seconds."""
        with self.s3.counting() as s3, self.ops.window() as files:
            started = time.perf_counter()
            what()
            seconds = time.perf_counter() - started
        return {
            "s3": s3.total,
            "s3_ops": dict(s3.by_operation),
            "file_ops": files.total,
            "seconds": round(seconds, 4),
        }


def settled_promoters(jobs: list[Job]) -> list[Any]:
    """A promoter per job, past its first pass and past the settling of what that pass read: the
    next pass of each has nothing to do and reads no marker again.

    A marker is trusted from the promoter's cache only once read :data:`SETTLE` seconds after it
    was first listed (coarse mtimes); a job just set up is younger than that, so every promoter
    makes a second pass after one shared wait.
    """
    from tierstore.promote.discovery import SETTLE
    from tierstore.promote.sidecar import Promoter

    promoters = [Promoter(job.config, node=0) for job in jobs]
    for promoter in promoters:
        promoter.run_once()
    time.sleep(SETTLE + 0.1)
    for promoter in promoters:
        promoter.run_once()
    return promoters
