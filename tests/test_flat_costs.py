"""Costs that stay flat as a job grows: the requests an operation makes, counted at the S3 server
(moto behind a counting WSGI layer), must not grow with the ranks' files of each checkpoint nor
with the number of checkpoints retained. ``benchmarks/costs.py`` measures the same to 10,000."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.request_counter import CountingS3, FileOps
from tests.simulated_job import Job, settled_promoters
from tierstore import Catalog, latest_committed
from tierstore.ids import MARKER_NAME
from tierstore.records.log import highest_in
from tierstore.records.protocol import claim
from tierstore.tiers import make_tier


@pytest.fixture(scope="module")
def counted_s3() -> Iterator[CountingS3]:
    with CountingS3() as s3:
        yield s3


@pytest.fixture(scope="module")
def file_ops() -> FileOps:
    return FileOps()


def _job(s3: CountingS3, ops: FileOps, root: Path, retained: int, ranks: int) -> Job:
    job = Job(s3, ops, root, f"t{retained}x{ranks}")
    job.populate(retained, ranks)
    return job


def test_s3_marker_scan_does_not_page_through_the_ranks_files(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    few = _job(counted_s3, file_ops, tmp_path, 12, 4)
    many = _job(counted_s3, file_ops, tmp_path, 12, 200)  # 2,400 data objects: 3 pages listed
    answers, requests = [], []
    for job in (few, many):
        tier = make_tier(job.config.tier("s3"), namespace=job.namespace, node=0)
        with counted_s3.counting() as seen:
            answers.append(sorted(tier.find_in_children(MARKER_NAME)))
        requests.append(seen.total)
    print(f"marker scan, 12 checkpoints of 4 and 200 ranks: {requests} requests")
    assert answers[0] == answers[1] and len(answers[0]) == 12
    assert requests[0] == requests[1] == 1, "one listing, whatever the ranks' files"


@pytest.mark.slow  # ~7 s: two simulated jobs of 10 and 200 retained checkpoints in four tiers
def test_idle_promoter_pass_and_latest_ask_the_tiers_the_same_however_many_are_kept(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """S3 requests, and file opens and listings in the node-local tiers (part records are read
    again only where a directory they came from changed)."""
    small = _job(counted_s3, file_ops, tmp_path, 10, 12)
    large = _job(counted_s3, file_ops, tmp_path, 120, 12)  # 1,800 objects: 2 pages a full listing
    jobs = [small, large]
    promoters = settled_promoters(jobs)
    passes, files, latest = [], [], []
    for job, promoter in zip(jobs, promoters, strict=True):
        file_ops.roots = tuple(str(root) for root in job.roots.values())
        with counted_s3.counting() as seen, file_ops.window() as opened:
            report = promoter.run_once()
        assert not report.deleted and not report.cleaned, "the pass had nothing to do"
        passes.append(seen.total)
        files.append(opened.total)
        with counted_s3.counting() as seen:
            assert latest_committed(job.config, node=0, collective=False) is not None
        latest.append(seen.total)
    print(f"idle pass at 10 and 120 kept: {passes} requests, {files} file operations;"
          f" latest_committed: {latest}")  # fmt: skip
    assert passes[0] == passes[1], passes
    assert files[0] == files[1], files
    assert latest[0] == latest[1], latest


def test_ls_reads_the_markers_of_the_page_it_shows(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    reads, newest = [], []
    for retained in (10, 100):
        job = _job(counted_s3, file_ops, tmp_path, retained, 2)
        with counted_s3.counting() as seen:
            listed = Catalog(job.config).listings(limit=5)
        reads.append(seen.by_operation["GET object"])
        newest.append([entry.checkpoint_id for entry in listed])
        assert listed[0].tiers == ("ram", "nvme", "pfs", "s3")
    assert len(Catalog(job.config).listings()) == 100, "without a limit: every one"
    print(f"ls --limit 5 over 10 and 100 kept: {reads} S3 marker reads")
    assert reads == [5, 5]
    assert newest[1] == [f"step_{i * 100:08d}" for i in range(100, 95, -1)]


def test_a_claim_above_a_known_number_lists_only_the_log_after_it(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """A save knows the highest number it has seen (its plan, the start-up look): the claim and
    the checks around it list the S3 commit log from there (``StartAfter``), not all of it."""
    requests = []
    for retained in (10, 1_200):  # 1,200 log entries: two pages of a full listing
        job = _job(counted_s3, file_ops, tmp_path, retained, 1)
        tier = make_tier(job.config.tier("s3"), namespace=job.namespace, node=0)
        with counted_s3.counting() as seen:
            assert highest_in(tier, above=retained) == retained
            assert claim(tier, "fresh", "g00000000000000000000", floor=retained) == retained + 1
        requests.append(seen.total)
        assert highest_in(tier, above=retained - 3) == retained + 1, "entries above are seen"
        assert highest_in(tier) == retained + 1
    print(f"highest_in + claim above the known number at 10 and 1,200 kept: {requests} requests")
    assert requests[0] == requests[1], requests
