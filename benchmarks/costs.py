"""Costs as jobs grow: requests and time per operation against ranks and retained checkpoints.

    python benchmarks/costs.py [--retained 10 100 1000 10000] [--ranks 8 64 256 1024] [--out DIR]

A simulated job in one process, with tierstore's real code paths and four tiers (``ram`` memory,
``nvme`` local, ``pfs`` shared, all on tmpfs here, and ``s3``: moto's server on loopback behind a
counter of HTTP requests, :class:`tests.request_counter.CountingS3`). File operations on the POSIX
tiers are counted by Python's audit hooks (:class:`tests.request_counter.FileOps`: opens, listings,
renames, removals; stats are not audited). Nothing in tierstore is patched.

* **Retained checkpoints** (one file per rank, 8 ranks): N committed checkpoints in every tier, set
  up directly in the tiers' layout (the files, the marker the protocol writes, the commit-log entry;
  S3 objects are stored into moto's backend without HTTP: the cheap path that makes 10,000 possible).
  Measured: a promoter's first pass (it reads every marker, and leaves its sightings as in a job), a
  pass with nothing to do (the same promoter's third: its marker cache trusts a marker read
  :data:`~tierstore.promote.discovery.SETTLE` s after it was listed; it reads each tier's change
  stamp and reuses its listings, :mod:`tierstore.promote.views`), the same pass when a full listing
  is due (every ``promote.full_scan``: it lists every tier, as every pass did before the stamp; the
  second such, when the cache trusts every marker),
  ``latest_committed``, a
  restore's tier choice (:func:`tierstore.dcp.restore.choice.choose_copy`), ``tierstore ls``
  (:meth:`Catalog.listings` at its default page of 50, and ``--limit 0`` up to 1,000), a save of
  8 ranks' files through the commit protocol (every file written, then
  :func:`tierstore.records.protocol.claim` and :func:`~tierstore.records.protocol.publish`) and a
  real ``dcp.save`` into the S3 tier (``tier="s3"``, one rank).
* **Ranks** (files per checkpoint, 10 retained): the same, the protocol save writing that many files.
* **SeaweedFS** (``--seaweed N``, default 1,000): the times of ``ls`` and ``latest_committed`` with the
  S3 tier on a real server (moto lists a bucket in Python, every key of it for each page).

The job's ``probe_timeout`` is an hour: a slow listing is measured, not cut short (with the default
10 s, a promoter's first pass over 10,000 checkpoints gives up on S3 and on the local disk tier).

Writes a table to stdout and ``costs.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.request_counter import CountingS3, FileOps
from tests.simulated_job import BLOB, Job, manifest_for
from tierstore.config import Config


def protocol_save(config: Config, namespace: str, index: int, ranks: int) -> Callable[[], None]:
    """A save of ``ranks`` files into the S3 tier through the commit protocol (claim, publish)."""
    from tierstore.records.protocol import claim, publish
    from tierstore.signing import MarkerTrust
    from tierstore.tiers import make_tier

    tier = make_tier(config.tier("s3"), namespace=namespace, node=0)

    def save() -> None:
        manifest = manifest_for(index, ranks, namespace)
        for entry in manifest.files:
            tier.write_bytes(f"{manifest.checkpoint_id}/{entry.path}", BLOB)
        seq = claim(tier, manifest.checkpoint_id, manifest.generation)
        assert (
            publish(tier, manifest.with_changes(seq=seq), replace=False, log=False, trust=MarkerTrust())
            is None
        )

    return save


def dcp_save(job: Job, checkpoint_id: str) -> Callable[[], None]:
    """A real ``dcp.save`` of a small state into the S3 tier (``tier="s3"``), one rank."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierstore import TieredWriter

    state = {f"w{i}": torch.zeros(16) for i in range(8)}

    def save() -> None:
        dcp.save(state, storage_writer=TieredWriter(job.config, tier="s3"), checkpoint_id=checkpoint_id)

    return save


def point(s3: CountingS3, ops: FileOps, root: Path, retained: int, ranks: int) -> dict[str, Any]:
    """Every operation's cost in one job of ``retained`` checkpoints of ``ranks`` files."""
    from tierstore import Catalog, latest_committed
    from tierstore.dcp.restore.choice import choose_copy
    from tierstore.promote.discovery import SETTLE
    from tierstore.promote.sidecar import Promoter
    from tierstore.records.sightings import trust_period

    job = Job(s3, ops, root, f"r{retained}x{ranks}-{len(os.listdir(root))}")
    started = time.perf_counter()
    job.populate(retained, ranks)
    setup_s = time.perf_counter() - started
    row: dict[str, Any] = {"retained": retained, "ranks": ranks, "setup_s": round(setup_s, 1)}
    promoter = Promoter(job.config, node=0)
    row["promoter first pass"] = job.measure(promoter.run_once)
    time.sleep(SETTLE)  # then the markers it read are trusted from its cache (see MarkerCache)
    promoter.run_once()
    row["promoter idle pass"] = job.measure(promoter.run_once)
    full_scan, promoter.views.full_scan = promoter.views.full_scan, 0.0  # a full listing is due
    promoter.run_once()  # the first one reads the markers the cache does not trust yet, once
    row["promoter full-scan pass"] = job.measure(promoter.run_once)
    promoter.views.full_scan = full_scan
    newest = manifest_for(retained, ranks, job.namespace).checkpoint_id
    answer: list[str | None] = []
    row["latest_committed"] = job.measure(
        lambda: answer.append(latest_committed(job.config, node=0, collective=False))
    )
    assert answer == [newest], (answer, newest)
    tiers = job.config.make_tiers(node=0)
    # A restore trusts the sightings for three promoter intervals, as TieredReader does (with
    # choose_copy's default of 30 s, the 10,000 point's sightings, written during a first pass of
    # two minutes, were too old and the choice asked S3 for the copy).
    trust = trust_period(job.config.promote.interval)
    row["restore tier choice"] = job.measure(
        lambda: choose_copy(
            tiers,
            newest,
            mirrored=job.config.mirrored,
            node=0,
            verify=False,
            collective=False,
            sighting_trust=trust,
            trust=job.config.marker_trust(),
        )
    )
    listed: list[int] = []
    row["tierstore ls"] = job.measure(  # the CLI's default page
        lambda: listed.append(len(Catalog(job.config).listings(limit=LS_PAGE)))
    )
    assert listed == [min(retained, LS_PAGE)], listed
    if retained <= 1000:  # every marker of every tier: 10,000 S3 GETs would take minutes here
        row["ls --limit 0"] = job.measure(lambda: Catalog(job.config).listings())
    row["protocol save to s3"] = job.measure(protocol_save(job.config, job.namespace, retained + 1, ranks))
    row["dcp.save to s3"] = job.measure(dcp_save(job, f"step_{(retained + 2) * 100:08d}"))
    for root_dir in job.roots.values():
        shutil.rmtree(root_dir, ignore_errors=True)
    return row


def seaweed_point(s3: CountingS3, ops: FileOps, root: Path, retained: int) -> dict[str, Any]:
    """Times of ``ls`` and ``latest_committed`` over ``retained`` checkpoints of 8 ranks in four
    tiers whose S3 tier is a real server (SeaweedFS on loopback): moto lists a bucket in Python,
    every key of it per page, which a real store does not."""
    from tests.s3server import seaweed_server
    from tierstore import Catalog, latest_committed

    row: dict[str, Any] = {"retained": retained, "ranks": 8}
    with seaweed_server(root / "seaweed") as server:
        job = Job(s3, ops, root, f"seaweed{retained}", endpoint=server.endpoint)
        started = time.perf_counter()
        job.populate(retained, 8)
        row["setup_s"] = round(time.perf_counter() - started, 1)
        for name, what in (
            ("tierstore ls", lambda: Catalog(job.config).listings(limit=LS_PAGE)),
            ("ls --limit 0", lambda: Catalog(job.config).listings()),
            ("latest_committed", lambda: latest_committed(job.config, node=0, collective=False)),
        ):
            what()  # the first call of a process also builds its clients
            seconds = []
            for _ in range(3):
                started = time.perf_counter()
                what()
                seconds.append(time.perf_counter() - started)
            row[name] = round(sorted(seconds)[1], 3)
    print(
        f"  SeaweedFS, {retained} x 4 tiers: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in row.items() if k not in ("retained", "ranks", "setup_s"))
    )
    return row


LS_PAGE = 50
"""``tierstore ls``'s default ``--limit``."""
OPERATIONS = (
    "latest_committed",
    "restore tier choice",
    "promoter idle pass",
    "promoter full-scan pass",
    "tierstore ls",
    "ls --limit 0",
    "protocol save to s3",
    "dcp.save to s3",
    "promoter first pass",
)


def show(rows: list[dict[str, Any]], axis: str) -> None:
    """One table per sweep: S3 requests / file operations / seconds of each operation."""
    print(f"\n{axis:>9}  " + "  ".join(f"{op[:22]:>22}" for op in OPERATIONS))
    print(f"{'':>9}  " + "  ".join(f"{'S3  files  seconds':>22}" for _ in OPERATIONS))
    for row in rows:
        cells = [
            f"{r['s3']:>5} {r['file_ops']:>6} {r['seconds']:>8.3f}" if r else "-"
            for r in (row.get(op) for op in OPERATIONS)
        ]
        print(f"{row[axis]:>9}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retained", type=int, nargs="*", default=[10, 100, 1000, 10000])
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 256, 1024])
    parser.add_argument(
        "--seaweed",
        type=int,
        default=1000,
        metavar="N",
        help="time ls and latest over N checkpoints with SeaweedFS (0: skip)",
    )
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    print("costs as jobs grow: S3 requests, file operations, seconds per operation", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"retained": [], "ranks": [], "seaweed": []}
    root = Path(tempfile.mkdtemp(prefix="tierstore-costs-", dir="/dev/shm"))
    try:
        with CountingS3() as s3:
            ops = FileOps()
            for retained in args.retained:
                results["retained"].append(point(s3, ops, root, retained, 8))
            show(results["retained"], "retained")
            for ranks in args.ranks:
                results["ranks"].append(point(s3, ops, root, 10, ranks))
            show(results["ranks"], "ranks")
            if args.seaweed:
                results["seaweed"].append(seaweed_point(s3, ops, root, args.seaweed))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "costs.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'costs.json'}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
