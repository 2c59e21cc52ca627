"""What the promoters of N nodes ask of one job-wide S3 tier per second, as N grows.

    python benchmarks/fleet.py [--nodes 8 64 256 1250] [--retained 100] [--cycles 1] [--out DIR]

N simulated nodes in one process, each a real :class:`~tierstore.promote.sidecar.Promoter` with its
own node-local ``memory`` tier (a directory per node on tmpfs, empty: nothing to promote) and all
sharing one ``s3`` tier: moto's server behind a counter of HTTP requests by operation and record
(:class:`tests.request_counter.CountingS3`), holding ``--retained`` committed checkpoints of 8 ranks'
files (stored into moto's backend without HTTP, as ``benchmarks/costs.py`` does). Each simulated node
is a host of its own (``TIERSTORE_HOST``): one of them keeps the S3 tier (its lease), the others watch.

The passes are driven one after another, in real time with the deployed lease (:data:`LEASE`), and what
each asks of S3 is counted per *event*: a watcher's pass between lease reads, its lease read, its
pass that learns a change (a new commit) from the lease, which names the token of the keeper's newest
index (so a change is learnt once indexed: at the first lease read after it, or a lease read later);
the keeper's pass, its renewal, its pass after a change.
The rate for the deployed schedule (``promote.interval`` 10 s, ``keeper_lease`` 30 s, a change every
20 s) is then *composed* from those counts (:func:`rates`): the lease is read by elapsed time, and
running 1,250 promoters, each every 10 s, is beyond one process of two cores. A change is a checkpoint
committed into S3 through the protocol (claim, publish), as a save or a promotion makes it; its own
requests are the save's, not the promoters', and are not counted.

Writes a table to stdout and ``fleet.json`` to ``--out`` (``benchmarks/cost_plots.py`` plots it).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.costs import protocol_save
from tests.request_counter import CountingS3
from tests.simulated_job import layout, manifest_for
from tierstore.config import Config, config_from_dict
from tierstore.ids import HEAD_PATH
from tierstore.records.log import Head

LEASE = 30.0
"""The lease of the run, in real seconds, the deployed default: watchers read it once per lease, the
keeper renews it every third, and acts only within 90% of it after its last renewal, which
a pass that lists 1,000 retained on moto (seconds) must fit (the renewals here are made between
passes: the keeper's thread is not started, so that each request is counted where it belongs)."""
RANKS = 8
"""Files per checkpoint (each rank's one, and DCP's metadata)."""
LIMITS = {"GET/HEAD/LIST": 5500, "PUT/DELETE": 3500}
"""S3's documented request rates per second per partitioned prefix."""


@dataclass(frozen=True)
class Schedule:
    """The deployed schedule the rates are composed for (seconds)."""

    interval: float = 10.0
    """``promote.interval``: every node's promoter passes this often."""
    lease: float = 30.0
    """``promote.keeper_lease``."""
    change: float = 20.0
    """A new commit in the S3 tier this often."""
    renewals: int = 3
    """The keeper's renewals per lease (:data:`tierstore.promote.keeper.RENEWALS`); a watcher reads
    the lease once per lease (:meth:`tierstore.promote.keeper.Keeper.tick`)."""


def kind(request: str) -> str:
    """The class of S3's per-prefix limits a counted request (``GET object lease``) falls in."""
    if request.startswith("GET list"):
        return "LIST"
    if request.startswith(("GET", "HEAD")):
        return "GET/HEAD"
    return "PUT/DELETE"


class Events:
    """Requests counted per event: ``event -> [Counter of 'OP record' per sample]``."""

    def __init__(self) -> None:
        self.samples: dict[str, list[collections.Counter[str]]] = collections.defaultdict(list)
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def add(self, event: str, counted: collections.Counter[str], seconds: float) -> None:
        """One sample of ``event``, which took ``seconds``."""
        self.samples[event].append(counted)
        self.seconds[event] += seconds

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per event: samples, mean requests by ``OP record`` and by kind, the largest sample."""
        out: dict[str, dict[str, Any]] = {}
        for event, samples in self.samples.items():
            total: collections.Counter[str] = sum(samples, collections.Counter())
            by_kind: collections.Counter[str] = collections.Counter()
            for request, count in total.items():
                by_kind[kind(request)] += count
            out[event] = {
                "samples": len(samples),
                "requests": {r: round(c / len(samples), 3) for r, c in sorted(total.items())},
                "kinds": {k: round(by_kind[k] / len(samples), 3) for k in ("LIST", "GET/HEAD", "PUT/DELETE")},
                "max": max(sum(s.values()) for s in samples),
                "min": min(sum(s.values()) for s in samples),
                "seconds": round(self.seconds[event] / len(samples), 4),
            }
        return out


def rates(events: dict[str, dict[str, Any]], nodes: int, schedule: Schedule) -> dict[str, dict[str, float]]:
    """Requests per second by kind, per watcher, of the keeper, and of all ``nodes``, composed from
    the counts per event (see the module docstring): a watcher passes every ``interval``, reads the
    lease once per ``lease`` and learns at most one change per lease read; the keeper
    passes every ``interval``, renews ``renewals`` times a lease and lists after each change. Two
    cases: the keeper indexed the change before a renewal named it (``ready``), or a watcher's lease
    read came first and learnt nothing, the next one learns it (``late``)."""
    read_every = schedule.lease
    learnt = min(1 / schedule.change, 1 / read_every)  # several changes between two reads: one

    def per(event: str, k: str) -> float:
        return float(events[event]["kinds"][k])

    out: dict[str, dict[str, float]] = {}
    for case, change in (
        ("ready", lambda k: per("watcher change, index ready", k)),
        ("late", lambda k: per("watcher change, indexed late", k)),
    ):
        for k in ("LIST", "GET/HEAD", "PUT/DELETE"):
            watcher = (
                per("watcher pass", k) / schedule.interval
                + (per("watcher lease read", k) - per("watcher pass", k)) / read_every
                + (change(k) - per("watcher lease read", k)) * learnt
            )
            keeper = (
                per("keeper pass", k) / schedule.interval
                + per("keeper renewal", k) * schedule.renewals / schedule.lease
                + (per("keeper pass after a change", k) - per("keeper pass", k)) / schedule.change
            )
            out.setdefault(f"watcher ({case})", {})[k] = round(watcher, 4)
            out.setdefault(f"keeper ({case})", {})[k] = round(keeper, 4)
            out.setdefault(f"all nodes ({case})", {})[k] = round((nodes - 1) * watcher + keeper, 2)
    return out


def fleet_config(endpoint: str, bucket: str, root: Path, namespace: str) -> Config:
    """Every node's configuration: its own memory tier (``{node}``) and the one S3 tier."""
    return config_from_dict(
        {
            "namespace": namespace,
            # no full listing inside the run: its cost, once per full_scan, is left out of the rates
            "promote": {"keeper_lease": f"{LEASE}s", "full_scan": "1h"},
            "probe_timeout": "1h",  # a slow listing is measured, not cut short
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(root / "{node}")},
                {"name": "s3", "type": "s3", "url": f"s3://{bucket}/ts", "endpoint_url": endpoint},
            ],
        }
    )


@contextmanager
def host(name: str) -> Iterator[None]:
    """``TIERSTORE_HOST`` set to ``name`` inside: a promoter made there is a host of its own."""
    from tierstore.topology import HOST_VARIABLE

    before = os.environ.get(HOST_VARIABLE)
    os.environ[HOST_VARIABLE] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOST_VARIABLE, None)
        else:
            os.environ[HOST_VARIABLE] = before


class Fleet:
    """N promoters over one S3 tier of ``retained`` checkpoints, node 0 its keeper."""

    def __init__(self, s3: CountingS3, root: Path, nodes: int, retained: int) -> None:
        import boto3

        from tierstore.promote.sidecar import Promoter

        self.s3, self.retained, self.events = s3, retained, Events()
        self.namespace = f"fleet{nodes}x{retained}"
        bucket = f"costs-{self.namespace}"
        boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=bucket)
        objects = [
            (f"ts/{self.namespace}/{k}", v)
            for index in range(1, retained + 1)
            for k, v in layout(manifest_for(index, RANKS, self.namespace))
        ]
        objects.append((f"ts/{self.namespace}/{HEAD_PATH}", Head(retained, logged=True).encode()))
        s3.put_direct(bucket, objects)
        self.config = fleet_config(s3.endpoint, bucket, root / self.namespace, self.namespace)
        self.promoters = []
        for node in range(nodes):
            with host(f"fleet-node-{node}"):
                self.promoters.append(Promoter(self.config, node=node))
        self.keeper, self.watchers = self.promoters[0], self.promoters[1:]
        self.changes = 0

    def record(self, event: str, what: Callable[[], object], *, always: bool = True) -> None:
        """What ``what`` asked of S3 (by ``OP record``) and its seconds, as a sample of ``event``
        (unless it asked nothing and not ``always``)."""
        with self.s3.counting_records() as seen:
            started = time.perf_counter()
            what()
            seconds = time.perf_counter() - started
        if always or seen.by_operation:
            self.events.add(event, seen.by_operation, seconds)

    def renew(self) -> None:
        """The keeper's renewal when due (what its thread does), recorded if one was made."""
        self.record("keeper renewal", self.keeper.context.keepers.tick, always=False)

    def keep(self, *, passes: bool = True, event: str = "keeper pass") -> None:
        """The keeper's turn between two watcher passes: its renewal when due, and with ``passes``
        a pass right after it (a new listing and index where the tier changed), as ``event``."""
        renewals = len(self.events.samples["keeper renewal"])
        self.renew()
        if passes and len(self.events.samples["keeper renewal"]) > renewals:
            self.keeper_pass(event)

    def keeper_pass(self, event: str) -> None:
        """A pass of the keeper, as a sample of ``event``."""
        self.record(event, self.keeper.run_once)

    def change(self) -> None:
        """A new checkpoint committed into S3 (the save's own requests are not counted), and the
        keeper's next renewal (which names its newest index's token: the change is not indexed yet)."""
        self.changes += 1
        protocol_save(self.config, self.namespace, self.retained + self.changes, RANKS)()
        time.sleep(LEASE / 3)
        self.renew()

    def start(self) -> None:
        """Every promoter's first pass: the keeper claims the lease, lists and indexes the tier
        (reading every marker), then each watcher, the keeper renewing and indexing between them."""
        from tierstore.promote.discovery import SETTLE

        starting = "keeper pass while nodes start"
        self.keeper_pass("keeper first pass")
        time.sleep(SETTLE + 0.1)  # the markers it read are trusted from its cache from now on
        time.sleep(LEASE / 3)
        self.keep(event=starting)
        for watcher in self.watchers:
            self.keep(event=starting)
            self.record("watcher first pass", watcher.run_once)
        # each first pass stamped the tier once (sightings.py): the keeper indexes the last stamp,
        # and every watcher reads the lease that names it, and the index
        self.wait_for_reads()
        self.keep(event=starting)
        for watcher in self.watchers:
            self.keep(event=starting)
            self.record("watcher settling pass", watcher.run_once)

    def wait_for_reads(self) -> None:
        """Until every watcher's next pass reads the lease (a lease since the last)."""
        time.sleep(LEASE + 0.05)

    def twice(self, first: str) -> None:
        """After a lease, each watcher twice: a pass that reads the lease, as ``first``, and one
        right after it."""
        self.wait_for_reads()
        for watcher in self.watchers:
            self.keep()
            self.record(first, watcher.run_once)
            self.record("watcher pass", watcher.run_once)

    def change_indexed(self) -> None:
        """A change the keeper's pass indexes right after its renewal named it: each watcher's pass
        that reads the lease learns it (and reads the index), the next pass is idle again."""
        self.change()
        self.keeper_pass("keeper pass after a change")
        self.twice("watcher change, index ready")

    def change_late(self) -> None:
        """A change the keeper's renewal came before its pass indexed: the lease still names the
        token of the index the keeper wrote last, so each watcher's lease read learns nothing yet
        (the lease GET only); once the keeper's pass indexed it and a renewal named it, each
        watcher's next lease read learns it (the lease, the index)."""
        self.change()
        self.wait_for_reads()
        for watcher in self.watchers:
            self.keep(passes=False)  # renewals only: the change is not indexed yet
            self.record("watcher lease read, change not indexed", watcher.run_once)
            self.record("watcher pass", watcher.run_once)
        self.keeper_pass("keeper pass after a change")
        self.twice("watcher change, indexed late")


def point(s3: CountingS3, root: Path, nodes: int, retained: int, cycles: int) -> dict[str, Any]:
    """The counts per event and the composed rates of ``nodes`` promoters over ``retained``."""
    started = time.perf_counter()
    fleet = Fleet(s3, root, nodes, retained)
    setup_s = time.perf_counter() - started
    fleet.start()
    start_s = time.perf_counter() - started - setup_s
    print(f"  {nodes} nodes: set up in {setup_s:.0f} s, started in {start_s:.0f} s", flush=True)
    for _ in range(cycles):
        for phase in (lambda: fleet.twice("watcher lease read"), fleet.change_indexed, fleet.change_late):
            phase()
            print(f"  {nodes} nodes: {time.perf_counter() - started:.0f} s", flush=True)
    events = fleet.events.summary()
    row = {
        "nodes": nodes,
        "retained": retained,
        "setup_s": round(setup_s, 1),
        "start_s": round(start_s, 1),
        "measure_s": round(time.perf_counter() - started - setup_s - start_s, 1),
        "events": events,
        "schedule": asdict(Schedule()),
        "rates": rates(events, nodes, Schedule()),
    }
    shutil.rmtree(root / fleet.namespace, ignore_errors=True)
    return row


def show(rows: Iterable[dict[str, Any]]) -> None:
    """Per N: requests per event (mean per node), and the composed rates."""
    for row in rows:
        print(f"\n{row['nodes']} nodes, {row['retained']} retained ({row['start_s']} s to start):")
        for event, cell in row["events"].items():
            kinds = " ".join(f"{k} {v:g}" for k, v in cell["kinds"].items())
            print(
                f"  {event:<36} {kinds:<40} max {cell['max']:<5} {cell['seconds']:.3f} s"
                f"  ({cell['samples']} samples)"
            )
        for who, by_kind in row["rates"].items():
            print(f"  {who + ' /s':<36} " + " ".join(f"{k} {v:g}" for k, v in by_kind.items()))
    print(f"\nS3's limits per prefix: {LIMITS} requests/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[8, 64, 256, 1250])
    parser.add_argument("--retained", type=int, default=100)
    parser.add_argument("--cycles", type=int, default=1, help="rounds of the three measured cycles")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    print(
        f"fleet: S3 requests of N promoters, {args.retained} retained;"
        f" rates composed for {asdict(Schedule())}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tierstore-fleet-", dir="/dev/shm"))
    try:
        with CountingS3() as s3:
            for nodes in args.nodes:
                rows.append(point(s3, root, nodes, args.retained, args.cycles))
                show(rows[-1:])
                body = {"limits": LIMITS, "lease_run_s": LEASE, "fleet": rows}
                (out / "fleet.json").write_text(json.dumps(body, indent=1))  # after each point
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {out / 'fleet.json'}", flush=True)


if __name__ == "__main__":
    main()
