"""Request timelines of tierstore's S3 paths beside boto3's, on a real S3 server (SeaweedFS).

    python benchmarks/s3_timeline.py [--size 512MiB] [--tensors 32] [--rounds 3] [--out bench-results]

Every HTTP request this process makes to S3 is timed where botocore (and aiobotocore, under s3fs)
sends it: from the send to the response's headers, and for a download to the last read of its
body. Each round runs, in turn: tierstore's S3-only ``dcp.save``, boto3's ``upload_file`` at
concurrency 8 and 16, a promotion memory -> S3, a restore from S3 (a RAM tier in front without the
checkpoint), boto3's ``download_file`` at 8 and 16. For each, the median over rounds of:

* ``lead``: from the call to its first data request (a request moving >= 1 MiB), and the requests
  made before it; ``tail``: from the last data request's end to the call's return, and its requests;
* ``span``: first data byte to last; ``flight``: data requests in flight, time-weighted mean over
  the span, and the most at once; ``idle``: time within the span with no data request in flight.

A throw-away recorder, not part of :mod:`benchmarks.s3_real`'s ratios (wrapping ``_send`` costs a
few microseconds a request). Writes ``s3_timeline.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed.checkpoint as dcp
from boto3.s3.transfer import TransferConfig

from benchmarks.s3_real import BUCKET, Run, real_server_run
from tierstore import TieredReader, TieredWriter
from tierstore.promote.retention import delete_copy
from tierstore.promote.sidecar import Promoter
from tierstore.signing import MarkerTrust

DATA = 1 << 20
"""A request moving at least this many bytes is a data request."""


@dataclass
class Request:
    """One request: when it was sent, when it ended, what it was and how many bytes it moved."""

    start: float
    end: float
    kind: str
    nbytes: int


@dataclass
class Recorder:
    """Every S3 request of the process, appended as it ends (installed once)."""

    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        import aiobotocore.endpoint
        import botocore.endpoint

        sync_send = botocore.endpoint.Endpoint._send
        async_send = aiobotocore.endpoint.AioEndpoint._send

        def send(endpoint: Any, request: Any) -> Any:
            started = time.perf_counter()
            response = sync_send(endpoint, request)
            self._ended(request, response, started)
            return response

        async def send_async(endpoint: Any, request: Any) -> Any:
            started = time.perf_counter()
            response = await async_send(endpoint, request)
            self._ended(request, response, started)
            return response

        botocore.endpoint.Endpoint._send = send  # type: ignore[method-assign]
        aiobotocore.endpoint.AioEndpoint._send = send_async  # type: ignore[method-assign]

    def _ended(self, request: Any, response: Any, started: float) -> None:
        sent = int(request.headers.get("Content-Length", 0) or 0)
        got = int(response.headers.get("Content-Length", 0) or 0) if request.method == "GET" else 0
        entry = Request(started, time.perf_counter(), kind_of(request), sent + got)
        with self.lock:
            self.requests.append(entry)
        raw = getattr(response, "raw", None)
        if got and raw is not None and hasattr(raw, "readinto"):
            # a download ends at its body's last read, not at the headers
            for name in ("read", "readinto"):
                original = getattr(raw, name)

                def reading(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                    value = _original(*args, **kwargs)
                    entry.end = time.perf_counter()
                    return value

                setattr(raw, name, reading)

    @contextmanager
    def window(self) -> Iterator[list[Request]]:
        """The requests that start inside the block (filled in when it ends)."""
        found: list[Request] = []
        started = time.perf_counter()
        yield found
        ended = time.perf_counter()
        with self.lock:
            found.extend(r for r in self.requests if started <= r.start <= ended)
        found.append(Request(started, ended, "(call)", 0))


def kind_of(request: Any) -> str:
    """The S3 operation a request is, from its method and query."""
    query = parse_qs(urlsplit(request.url).query, keep_blank_values=True)
    if "partNumber" in query:
        return "UploadPart"
    if "uploads" in query:
        return "CreateMultipartUpload"
    if "uploadId" in query:
        return {"POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(
            request.method, "Parts"
        )
    if "list-type" in query or "prefix" in query or "delimiter" in query:
        return "List"
    if request.method == "GET":
        return "GetObject (range)" if "Range" in request.headers else "GetObject"
    return {"PUT": "PutObject", "DELETE": "DeleteObject", "HEAD": "HeadObject"}.get(
        request.method, request.method
    )


def shape(found: list[Request]) -> dict[str, Any]:
    """A call's timeline: its requests (the last entry is the call itself) as the figures above."""
    call, requests = found[-1], found[:-1]
    data = [r for r in requests if r.nbytes >= DATA]
    if not data:
        return {"wall_s": call.end - call.start, "requests": len(requests), "data_requests": 0}
    first, last = min(r.start for r in data), max(r.end for r in data)
    edges = sorted([(r.start, 1) for r in data] + [(r.end, -1) for r in data])
    in_flight, most, weighted, idle, at = 0, 0, 0.0, 0.0, first
    for moment, step in edges:
        weighted += in_flight * (moment - at)
        idle += (moment - at) if in_flight == 0 else 0.0
        in_flight += step
        most, at = max(most, in_flight), moment
    span = last - first
    return {
        "wall_s": call.end - call.start,
        "requests": len(requests),
        "data_requests": len(data),
        "lead_s": first - call.start,
        "lead_requests": sum(r.end <= first for r in requests),
        "span_s": span,
        "mean_in_flight": weighted / span if span else 0.0,
        "most_in_flight": most,
        "idle_s": idle,
        "tail_s": call.end - last,
        "tail_requests": sum(r.start >= last for r in requests),
        "mib_per_s": sum(r.nbytes for r in data) / 2**20 / span if span else 0.0,
        "lead_kinds": kinds_of(r for r in requests if r.end <= first),
        "tail_kinds": kinds_of(r for r in requests if r.start >= last),
    }


def kinds_of(requests: Iterable[Request]) -> dict[str, float]:
    """How many requests of each kind, and their summed seconds (``<kind> s``)."""
    found: dict[str, float] = {}
    for r in requests:
        found[r.kind] = found.get(r.kind, 0) + 1
        found[f"{r.kind} s"] = round(found.get(f"{r.kind} s", 0.0) + r.end - r.start, 4)
    return found


COLUMNS = (
    ("wall_s", "wall s", 2),
    ("lead_s", "lead s", 3),
    ("lead_requests", "lead req", 0),
    ("span_s", "span s", 2),
    ("data_requests", "data req", 0),
    ("mean_in_flight", "in flight", 1),
    ("most_in_flight", "most", 0),
    ("idle_s", "idle s", 3),
    ("tail_s", "tail s", 3),
    ("tail_requests", "tail req", 0),
    ("mib_per_s", "MiB/s", 0),
)


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table of the medians over rounds, one row per call."""
    lines = ["| call | " + " | ".join(label for _, label, _ in COLUMNS) + " |"]
    lines.append("| --- |" + " ---: |" * len(COLUMNS))
    for name, shapes in rows.items():
        cells = []
        for key, _, digits in COLUMNS:
            values = [s[key] for s in shapes if key in s]
            cells.append(f"{statistics.median(values):.{digits}f}" if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def record_rounds(run: Run, recorder: Recorder) -> dict[str, list[dict[str, Any]]]:
    """One untimed round to warm every client and the server, then ``--rounds`` recorded ones."""
    s3_only, behind_empty_ram = run.config("s3", prefix="saves"), run.config("ram", "s3", ram="ram-empty")
    promoted = "promoted"
    dcp.save(run.state, storage_writer=TieredWriter(run.config("ram", "s3")), checkpoint_id=promoted)
    promoter = Promoter(run.config("ram", "s3"))
    s3 = promoter.by_name["s3"]
    saves = itertools.count()

    def promote() -> None:
        report = promoter.run_once()  # its S3 copy deleted before, untimed
        assert report.promoted and not report.failed, report

    def boto3(move: str, concurrency: int) -> Callable[[], None]:
        config = TransferConfig(max_concurrency=concurrency)
        if move == "upload":
            return lambda: run.client.upload_file(str(run.blob), BUCKET, "boto3/object.bin", Config=config)
        return lambda: run.client.download_file(BUCKET, "boto3/object.bin", str(run.landing), Config=config)

    calls: dict[str, Callable[[], object]] = {
        "tierstore dcp.save, S3 only": lambda: dcp.save(
            run.state, storage_writer=TieredWriter(s3_only), checkpoint_id=f"save-{next(saves)}"
        ),
        "boto3 upload_file, concurrency 8": boto3("upload", 8),
        "boto3 upload_file, concurrency 16": boto3("upload", 16),
        "tierstore promotion memory -> S3": promote,
        "tierstore restore from S3 (RAM empty)": lambda: dcp.load(
            run.restored, storage_reader=TieredReader(behind_empty_ram), checkpoint_id=promoted
        ),
        "boto3 download_file, concurrency 8": boto3("download", 8),
        "boto3 download_file, concurrency 16": boto3("download", 16),
    }
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
    for index in range(-1, run.args.rounds):
        for name, call in calls.items():
            # untimed set-up: the promotion's S3 copy gone, the download's landing fresh memory
            if call is promote:
                delete_copy(s3, promoted, trust=MarkerTrust())
            run.landing.unlink(missing_ok=True)
            with recorder.window() as found:
                call()
            if index >= 0:
                rows[name].append(shape(found))
        print(f"  round {index + 1} of {run.args.rounds}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    args.tier, args.also, args.saves_only = [], [], False  # what s3_real's Run reads
    recorder = Recorder()
    recorder.install()
    with real_server_run(args) as run:
        rows = record_rounds(run, recorder)
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "s3_timeline.json").write_text(json.dumps({"arguments": vars(args), "calls": rows}, indent=1))
    print(f"\nwrote {out / 's3_timeline.json'}")


if __name__ == "__main__":
    main()
