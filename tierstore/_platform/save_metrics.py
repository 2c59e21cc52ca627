"""Trainer-side metrics: each rank's save stall, write and commit times, bytes and outcomes.

A port per rank would collide and move, and prometheus_client's multiprocess mode needs an environment
variable set before import and leaves files behind every pid. So each rank keeps one small file,
``rank-NNNNN.prom`` (Prometheus text format) in ``metrics.directory``, which the node's promoter serves
on its ``/metrics``. Every rank records after its files are durable (:meth:`SaveRecorder.written`,
:meth:`SaveRecorder.failed`), never on the trainer's thread under ``dcp.async_save``; the coordinator
once the marker is published (:meth:`SaveRecorder.committed`). A file is replaced through a rename,
under an advisory lock; its counters go on from the values it holds; recording never fails a save. The
series and where to put the directory: docs/operations.md, "Trainer-side metrics".
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

LABELS = ("rank", "tier")
"""Every trainer-side series carries the saving rank (global) and the tier saved into."""


@dataclass(frozen=True)
class Family:
    """One trainer-side metric: its name as registered (a counter's without ``_total``)."""

    name: str
    kind: str
    """``counter``, ``gauge`` or ``summary`` (a count and a sum, no quantiles)."""
    help: str

    @property
    def samples(self) -> tuple[str, ...]:
        """The names its series have when scraped."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "summary":
            return (f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


FAMILIES = (
    Family(
        "tierstore_save_stall_seconds",
        "summary",
        "Time the trainer was blocked by saves: staging (the copy out of its state, with any wait"
        " for the previous save); a plain dcp.save blocks until the rank's files are durable",
    ),
    Family("tierstore_save_last_stall_seconds", "gauge", "The stall of this rank's last save"),
    Family(
        "tierstore_save_last_wait_seconds",
        "gauge",
        "Part of the last stall spent waiting for the previous save to persist (back-pressure:"
        " save less often)",
    ),
    Family(
        "tierstore_save_write_seconds",
        "summary",
        "Time this rank took to write its files of a save until they were durable in the tier",
    ),
    Family("tierstore_save_last_write_seconds", "gauge", "The write time of this rank's last save"),
    Family(
        "tierstore_save_commit_seconds",
        "summary",
        "Coordinator: time from a save's start (staging) to its commit marker",
    ),
    Family(
        "tierstore_save_last_commit_seconds",
        "gauge",
        "Coordinator: the commit time of the last committed save",
    ),
    Family(
        "tierstore_save_written_bytes",
        "counter",
        "Bytes of the files this rank wrote into the tier by saving (DCP's .metadata aside)",
    ),
    Family("tierstore_saves_written", "counter", "Saves whose files this rank made durable in the tier"),
    Family(
        "tierstore_saves_failed",
        "counter",
        "Saves that failed on this rank: writing its files, the commit gate, or (coordinator) the commit",
    ),
    Family(
        "tierstore_saves_committed", "counter", "Coordinator: saves committed (marker published) in the tier"
    ),
    Family(
        "tierstore_save_last_written_timestamp_seconds",
        "gauge",
        "When this rank's files of its last save became durable",
    ),
    Family(
        "tierstore_save_last_committed_timestamp_seconds",
        "gauge",
        "Coordinator: when the last save was committed in the tier",
    ),
)
SAMPLE_NAMES = frozenset(s for f in FAMILIES for s in f.samples)
COUNTERS = tuple(s for f in FAMILIES if f.kind != "gauge" for s in f.samples)
"""The series that only grow (counters, and summaries' counts and sums): they start at 0."""
"""Every series name a rank's file can hold (what dashboards and alerts may name)."""

Values = dict[tuple[str, str], float]
"""``(tier, sample name) -> value``: one rank's series."""


def rank_file(rank: int) -> str:
    """The file name of ``rank``'s metrics (``.prom``: node-exporter's textfile collector reads it)."""
    return f"rank-{rank:05d}.prom"


class SaveRecorder:
    """Records one rank's saves into its file in ``directory`` (None: recording is off).

    Plain data, so it travels with a pickled writer into DCP's checkpoint process. Thread-safety:
    one save at a time per recorder (a writer's saves are serialised by staging's back-pressure)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._stall: tuple[float | None, float | None] = (None, None)
        self._warned = False
        self._started: set[tuple[int, str]] = set()

    def started(self, rank: int, tier: str) -> None:
        """A save begins on this rank: every counter of the tier exists from now, at 0 if new. A
        series that appears only at its first increment is invisible to ``increase()``: the first
        failed save would fire no alert."""
        if (rank, tier) not in self._started:
            self._started.add((rank, tier))
            self._update(rank, tier, dict.fromkeys(COUNTERS, 0.0), {})

    def staged(self, stall_s: float | None, wait_s: float | None) -> None:
        """The stall (and its back-pressure wait) measured when this save was staged; None when
        the save was not staged (``dcp.save``). Kept until the rank's outcome is recorded."""
        self._stall = (stall_s, wait_s)

    def written(self, rank: int, tier: str, *, nbytes: int, write_s: float, save_s: float) -> None:
        """This rank's files of a save are durable: ``nbytes`` written in ``write_s`` seconds,
        ``save_s`` after the rank set the save up (its stall when the save was not staged)."""
        now = time.time()
        add, put = self._stall_updates(save_s)
        add |= {
            "tierstore_save_write_seconds_count": 1,
            "tierstore_save_write_seconds_sum": write_s,
            "tierstore_save_written_bytes_total": nbytes,
            "tierstore_saves_written_total": 1,
        }
        put |= {
            "tierstore_save_last_write_seconds": write_s,
            "tierstore_save_last_written_timestamp_seconds": now,
        }
        self._update(rank, tier, add, put)

    def failed(self, rank: int, tier: str, *, save_s: float | None = None) -> None:
        """A save failed on this rank (its stall, already paid, counts too)."""
        add, put = self._stall_updates(save_s)
        add["tierstore_saves_failed_total"] = 1
        self._update(rank, tier, add, put)

    def committed(self, rank: int, tier: str, *, commit_s: float) -> None:
        """Coordinator: the save's marker is published, ``commit_s`` after the save started."""
        add = {
            "tierstore_save_commit_seconds_count": 1,
            "tierstore_save_commit_seconds_sum": commit_s,
            "tierstore_saves_committed_total": 1,
        }
        put = {
            "tierstore_save_last_commit_seconds": commit_s,
            "tierstore_save_last_committed_timestamp_seconds": time.time(),
        }
        self._update(rank, tier, add, put)

    def _stall_updates(self, save_s: float | None) -> tuple[dict[str, float], dict[str, float]]:
        stall, wait = self._stall
        self._stall = (None, None)
        stall = save_s if stall is None else stall  # not staged: the trainer waited for it all
        if stall is None:
            return {}, {}
        put = {"tierstore_save_last_stall_seconds": stall}
        if wait is not None:
            put["tierstore_save_last_wait_seconds"] = wait
        add = {"tierstore_save_stall_seconds_count": 1.0, "tierstore_save_stall_seconds_sum": stall}
        return add, put

    def _update(self, rank: int, tier: str, add: Mapping[str, float], put: Mapping[str, float]) -> None:
        if self.directory is None:
            return
        path = os.path.join(self.directory, rank_file(rank))
        try:
            os.makedirs(self.directory, exist_ok=True)
            with _locked(os.path.join(self.directory, f".rank-{rank:05d}.lock")):
                values = read_values(path, rank)
                for name, amount in add.items():
                    values[(tier, name)] = values.get((tier, name), 0.0) + amount
                values.update({(tier, name): value for name, value in put.items()})
                _replace(path, render(rank, values))
        except Exception as exc:  # noqa: BLE001 - metrics never fail a save
            if not self._warned:
                self._warned = True
                logger.warning("cannot record save metrics in %s (further failures quiet): %s", path, exc)


@contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace(path: str, text: bytes) -> None:
    """Write ``path`` through a temporary file and a rename. No fsync: metrics need not outlive
    the node, and the trainer's disk is not theirs to wait on."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # not *.prom: never read
    try:
        with open(temporary, "wb") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:  # a full disk: leave no temporary file behind
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


MAX_FILE_BYTES = 1 << 20
"""A rank's file holds a few dozen lines; anything larger is not one, and is not read whole."""


def read_small_text(path: str) -> str:
    """The UTF-8 text of the regular file ``path``. ``ValueError`` for anything else: a FIFO or a
    device (opened without blocking, never read), a file over :data:`MAX_FILE_BYTES`, bytes that
    are not UTF-8. ``FileNotFoundError`` when it is not there."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a metrics file holds")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(MAX_FILE_BYTES + 1).decode("utf-8")
    finally:
        os.close(fd)


def read_values(path: str, rank: int) -> Values:
    """The series ``rank`` left in ``path`` (empty if there is no file, or none readable: the
    counts then start over, with one log line)."""
    values: Values = {}
    try:
        text = read_small_text(path)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in SAMPLE_NAMES and sample.labels.get("rank") == str(rank):
                    values[(sample.labels.get("tier", ""), sample.name)] = float(sample.value)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        logger.warning("%s is not Prometheus text (counting again from 0): %s", path, exc)
        return {}
    return values


def render(rank: int, values: Values) -> bytes:
    """``rank``'s series in Prometheus's text format (HELP and TYPE lines included)."""
    registry = CollectorRegistry()
    registry.register(_Snapshot(rank, values))
    data: bytes = generate_latest(registry)
    return data


class _Snapshot:
    """A collector yielding fixed values (what :func:`render` formats)."""

    def __init__(self, rank: int, values: Values) -> None:
        self.rank = str(rank)
        self.values = values

    def collect(self) -> Iterator[Metric]:
        tiers = sorted({tier for tier, _name in self.values})
        for family in FAMILIES:
            metric: Any
            if family.kind == "counter":
                metric = CounterMetricFamily(family.name, family.help, labels=LABELS)
            elif family.kind == "gauge":
                metric = GaugeMetricFamily(family.name, family.help, labels=LABELS)
            else:
                metric = SummaryMetricFamily(family.name, family.help, labels=LABELS)
            for tier in tiers:
                found = [self.values.get((tier, s)) for s in family.samples]
                if any(v is None for v in found):
                    continue
                if family.kind == "summary":
                    metric.add_metric([self.rank, tier], count_value=found[0], sum_value=found[1])
                else:
                    metric.add_metric([self.rank, tier], found[0])
            if metric.samples:
                yield metric


def _rank_of_file(name: str) -> str | None:
    """``"7"`` for ``rank-00007.prom``; None for any other file (whose series carry no rank)."""
    number = name.removeprefix("rank-").removesuffix(".prom")
    if name.startswith("rank-") and number.isdigit():
        return str(int(number))
    return None


def read_directory(directory: str, *, stale_after: float = 0.0) -> list[Metric]:
    """Every metric family in the ``*.prom`` files of ``directory``, the series of all files merged
    per family (what the promoter serves). Files not rewritten for ``stale_after`` seconds (0: no
    limit) are left out: ranks of an earlier job, or of a smaller world. A file that cannot be read
    or parsed, or a family whose type differs from another file's, is skipped with a log line."""
    now = time.time()
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".prom") and not n.startswith("."))
    except FileNotFoundError:
        return []
    except OSError as exc:  # not a directory, unreadable: the promoter's own metrics still serve
        logger.warning("cannot list the metrics directory %s: %s", directory, exc)
        return []
    for name in names:
        path = os.path.join(directory, name)
        owner = _rank_of_file(name)
        try:
            if stale_after > 0 and now - os.stat(path).st_mtime > stale_after:
                continue
            families = list(text_string_to_metric_families(read_small_text(path)))
        except (OSError, ValueError) as exc:
            logger.warning("skipping metrics file %s: %s", path, exc)
            continue
        for family in families:
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if into.type != family.type:
                logger.warning(
                    "skipping %s in %s: a %s here, a %s elsewhere", family.name, path, family.type, into.type
                )
                continue
            for sample in family.samples:  # a series twice would fail the whole scrape
                if sample.labels.get("rank") != owner:
                    continue  # a rank's series come from that rank's own file only
                key = (sample.name, frozenset(sample.labels.items()))
                if key not in seen:
                    seen.add(key)
                    into.samples.append(sample)
    return list(merged.values())
