"""Costs that stay flat as a job grows: the requests an operation makes, counted at the S3 server
(moto behind a counting WSGI layer), must not grow with the ranks' files of each checkpoint nor
with the number of checkpoints retained. ``benchmarks/costs.py`` measures the same to 10,000."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.request_counter import CountingS3, FileOps
from tests.simulated_job import BLOB, Job, manifest_for, settled_promoters
from tierstore import Catalog, latest_committed
from tierstore.cli import main as cli_main
from tierstore.ids import INTERNAL_DIR, MARKER_NAME
from tierstore.promote.discovery import SeenCopy
from tierstore.promote.retention import delete_copy
from tierstore.promote.sidecar import Promoter
from tierstore.records.index import Index, write_index
from tierstore.records.log import highest_in
from tierstore.records.protocol import claim, publish
from tierstore.signing import MarkerTrust
from tierstore.tiers import make_tier


def protocol_save_into(job: Job, tier_name: str, index: int, ranks: int = 2) -> None:
    """A save of checkpoint ``index`` into ``tier_name`` through the commit protocol: every file
    written, then :func:`~tierstore.records.protocol.claim` and
    :func:`~tierstore.records.protocol.publish` (what a writer's commit does)."""
    tier = make_tier(job.config.tier(tier_name), namespace=job.namespace, node=0)
    manifest = manifest_for(index, ranks, job.namespace)
    for entry in manifest.files:
        tier.write_bytes(f"{manifest.checkpoint_id}/{entry.path}", BLOB)
    seq = claim(tier, manifest.checkpoint_id, manifest.generation)
    assert (
        publish(tier, manifest.with_changes(seq=seq), replace=False, log=False, trust=MarkerTrust()) is None
    )


def protocol_save(job: Job, index: int, ranks: int) -> Callable[[], None]:
    """:func:`protocol_save_into` the S3 tier, to call later."""
    return lambda: protocol_save_into(job, "s3", index, ranks)


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
    print(
        f"idle pass at 10 and 120 kept: {passes} requests, {files} file operations;"
        f" latest_committed: {latest}"
    )
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
    assert reads == [5 + 1, 5 + 1], "the page's five markers and S3's head record: flat"
    assert newest[1] == [f"step_{i * 100:08d}" for i in range(100, 95, -1)]


@pytest.mark.slow  # ~4 s: a simulated job of 1,200 retained checkpoints in four tiers
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


@pytest.mark.slow  # ~15 s: two simulated jobs of 40 and 400 retained checkpoints in four tiers
def test_an_idle_pass_asks_each_tier_the_same_over_n_and_10n_retained(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """A pass with nothing to do reads each tier's change stamp and reuses its last listing
    (promote/views.py): the same S3 requests and file operations over 40 retained checkpoints
    as over 400, whose S3 marker listing is two pages and whose disks hold ten times the
    directories."""
    jobs = [_job(counted_s3, file_ops, tmp_path, retained, 2) for retained in (40, 400)]
    promoters = settled_promoters(jobs)
    passes, files, operations = [], [], []
    for job, promoter in zip(jobs, promoters, strict=True):
        file_ops.roots = tuple(str(root) for root in job.roots.values())
        for _ in range(2):  # the second of two idle passes in a row costs the same too
            with counted_s3.counting() as seen, file_ops.window() as opened:
                report = promoter.run_once()
            assert not report.promoted and not report.deleted and not report.cleaned
        passes.append(seen.total)
        files.append(opened.total)
        operations.append(dict(seen.by_operation))
    print(f"idle pass at 40 and 400 kept: {passes} requests {operations}, {files} file operations")
    assert passes[0] == passes[1], operations
    assert files[0] == files[1], files
    written = [op for op in operations[1] if not op.startswith(("GET", "HEAD"))]
    assert written == [], "a pass with nothing to do writes nothing to S3 (no clock probe)"


def _observed_job(
    s3: CountingS3, ops: FileOps, root: Path, retained: int, *, full_scan: float = 300.0
) -> tuple[Job, Promoter]:
    """A job of ``retained`` checkpoints and its promoter past its first pass, whose listings
    stay reusable for ``full_scan`` seconds."""
    job = _job(s3, ops, root, retained, 2)
    job.config = job.config.model_copy(
        update={"promote": job.config.promote.model_copy(update={"full_scan": full_scan})}
    )
    promoter = Promoter(job.config, node=0)
    promoter.run_once()
    return job, promoter


def _config_file(job: Job, root: Path) -> Path:
    path = root / f"{job.namespace}.yaml"
    tiers = [
        {"name": n, "type": t, "path": str(job.roots[n])}
        for n, t in (("ram", "memory"), ("nvme", "local"), ("pfs", "shared"))
    ]
    tiers.append({"name": "s3", "type": "s3", "url": f"s3://{job.bucket}/ts", "endpoint_url": job.endpoint})
    path.write_text(yaml.safe_dump({"namespace": job.namespace, "tiers": tiers}))
    return path


def test_a_change_by_each_tierstore_actor_is_seen_by_the_next_pass(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """The promoter keeps its listings for five minutes here; every change a tierstore actor
    makes is still in its very next look: a save's commit, another promoter's copy, retention's
    delete, an operator's ``tierstore drop``."""
    job, promoter = _observed_job(counted_s3, file_ops, tmp_path, 6)
    s3 = make_tier(job.config.tier("s3"), namespace=job.namespace, node=0)

    protocol_save(job, 7, 2)()  # a save committed straight into S3 (claim, publish)
    assert "step_00000700" in promoter.catalog()["s3"], "a save's commit"

    other = Promoter(job.config, node=0)  # another promoter, as on another node after a restart
    protocol_save_into(job, "ram", 8)
    promoter.catalog()  # the new id is in ram, not yet below
    other.run_once()  # copies it down every tier
    found = promoter.catalog()
    assert all("step_00000800" in found[name] for name in ("nvme", "pfs", "s3")), "a copy"

    delete_copy(s3, "step_00000100", trust=MarkerTrust())  # retention's routine
    assert "step_00000100" not in promoter.catalog()["s3"], "retention's delete"

    assert (
        cli_main(["--config", str(_config_file(job, tmp_path)), "drop", "step_00000200", "--tier", "pfs"])
        == 0
    )
    assert "step_00000200" not in promoter.catalog()["pfs"], "an operator's drop"


def test_a_change_behind_tierstores_back_is_seen_within_full_scan(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """An operator's ``aws s3 rm`` stamps nothing: the promoter sees it at its next full listing,
    ``promote.full_scan`` after the previous one at most (real time)."""
    full_scan = 1.0
    job, promoter = _observed_job(counted_s3, file_ops, tmp_path, 4, full_scan=full_scan)
    promoter.catalog(full=True)
    listed = time.monotonic()
    job.client.delete_object(Bucket=job.bucket, Key=f"ts/{job.namespace}/step_00000300/commit.json")
    while "step_00000300" in promoter.catalog()["s3"]:
        assert time.monotonic() - listed < full_scan + 1.0, "not seen within full_scan"
        time.sleep(0.1)
    assert time.monotonic() - listed < full_scan + 1.0


def test_a_publish_checks_its_files_in_s3_by_listing_not_a_head_each(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """The marker's two presence checks (before it is published, and after, for files removed
    meanwhile) list the generation: a request per 1,000 files, not a HEAD per file. 8 and 64 files
    per checkpoint make the same number of requests beyond their PUTs."""
    beyond_puts, heads = [], []
    for ranks in (8, 64):
        job = _job(counted_s3, file_ops, tmp_path, 2, ranks)
        with counted_s3.counting() as seen:
            protocol_save(job, 3, ranks)()
        puts = seen.by_operation.get("PUT object", 0)
        beyond_puts.append(seen.total - puts)
        heads.append(seen.by_operation.get("HEAD object", 0))
    print(f"a protocol save of 8 and 64 files: {beyond_puts} requests besides the PUTs, {heads} HEADs")
    assert beyond_puts[0] == beyond_puts[1], beyond_puts
    assert heads[1] < 8, "no HEAD per file"


@pytest.mark.slow  # ~6 s: simulated jobs of 10 and 1,200 retained checkpoints in four tiers
def test_latest_committed_and_the_start_up_look_list_the_log_only_above_the_head(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """With the head record the protocol keeps, ``latest_committed`` (no promoter has sighted the
    tiers: each is listed) asks S3 at most 5 requests at 10 and at 1,200 retained, and the same
    file operations; the start-up look lists the S3 log above the head: what it asks beyond the
    marker listing (a page per ~300 ids, until an index replaces it) is the same at both."""
    from tierstore._platform.bounded import Prober
    from tierstore.records.known import Elsewhere

    latest, files, looks, plain, skipping = [], [], [], [], []
    for retained in (10, 1_200):  # 1,200 log entries: two pages of a full listing
        job = _job(counted_s3, file_ops, tmp_path, retained, 1)
        answer: list[str | None] = []
        cost = job.measure(
            lambda j=job, a=answer: a.append(latest_committed(j.config, node=0, collective=False))
        )
        assert answer == [manifest_for(retained, 1, job.namespace).checkpoint_id]
        latest.append(cost["s3"])
        files.append(cost["file_ops"])
        s3 = make_tier(job.config.tier("s3"), namespace=job.namespace, node=0)
        markers = job.measure(lambda t=s3: t.find_in_children(MARKER_NAME, besides=INTERNAL_DIR))["s3"]
        plain.append(job.measure(lambda t=s3: t.find_in_children(MARKER_NAME))["s3"])
        skipping.append(markers)
        tiers = job.config.make_tiers(node=0)
        look = job.measure(lambda t=tiers, j=job: Elsewhere().look(t, Prober(60), j.config.marker_trust()))
        looks.append(look["s3"] - markers)
    print(f"latest_committed at 10 and 1,200 kept: S3 {latest}, files {files}; look beyond markers {looks}")
    assert max(latest) <= 5, latest
    assert files[1] <= files[0], files
    assert looks[0] == looks[1] <= 2, looks
    # the marker listing jumps over the commit log's keys (tests/tiers/test_s3_listing.py): never
    # a request more than the plain listing (at 1,200 retained, the log is one page either way)
    assert skipping[0] <= plain[0] and skipping[1] <= plain[1], (skipping, plain)


def test_a_promoters_listing_reads_the_highest_number_above_the_head(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """A promoter's listing of a tier takes its highest number from the log above the head record
    (one page), not from the whole log (a page per thousand commits): the same number, in two S3
    requests at any retained count; without a head record, the whole log."""
    from tierstore.ids import HEAD_PATH
    from tierstore.records.log import highest_in, highest_taken

    job = Job(counted_s3, file_ops, tmp_path, "head1200")  # a namespace no other test saves into
    job.populate(1_200, 1)
    s3 = make_tier(job.config.tier("s3"), namespace=job.namespace, node=0)
    whole = job.measure(lambda: highest_in(s3))
    above = job.measure(lambda: highest_taken(s3))
    assert highest_taken(s3) == highest_in(s3) == 1_200
    assert whole["s3_ops"] == {"GET list": 2}, whole
    assert above["s3_ops"] == {"GET object": 1, "GET list": 1}, above  # the head, one page
    s3.delete(HEAD_PATH)
    assert highest_taken(s3) == 1_200
    s3.delete(
        f".tierstore/commits/{1_200:012d}~{manifest_for(1_200, 1, job.namespace).checkpoint_id}~"
        f"{manifest_for(1_200, 1, job.namespace).generation}"
    )
    assert highest_taken(s3) == 1_199, "no head record: the log, whole"


def test_a_node_that_does_not_keep_a_job_wide_tier_asks_it_nothing_between_lease_reads(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path
) -> None:
    """Another node's promoter keeps the job-wide tiers (its lease records stand, written by the
    test as a keeper on another host renews them: with the tier's change stamp it read first): this
    node's idle passes between two lease reads read neither S3's stamp (the lease names it) nor its
    lease, nor any activity record: what 1,250 nodes ask of S3 does not grow with how often they
    pass (one lease read per node per two thirds of a lease)."""
    from tierstore.promote.discovery import SETTLE
    from tierstore.records import lease
    from tierstore.records.changes import read_stamp

    job = _job(counted_s3, file_ops, tmp_path, 100, 2)
    elsewhere = lease.Holder(0, "another-host", "pidns", 1, "their-token", time.time())
    for name in ("pfs", "s3"):
        tier = make_tier(job.config.tier(name), namespace=job.namespace, node=0)
        assert lease.claim(tier, lease.Lease(1, elsewhere).renewed(read_stamp(tier)))
    watcher = Promoter(job.config, node=1)
    watcher.run_once()  # lists every tier, reads the leases: kept by another node
    time.sleep(SETTLE + 0.1)
    watcher.run_once()
    assert set(watcher.context.keepers.watched()) == {"pfs", "s3"}
    started = time.monotonic()
    with counted_s3.counting() as seen:
        for _ in range(5):
            watcher.run_once()
    assert time.monotonic() - started < job.config.promote.keeper_lease / 2, "within one lease read"
    assert seen.total == 0, seen.by_operation


def _index_as_the_keeper(job: Job, tier_name: str) -> Index:
    """What the keeper of ``tier_name`` on another node indexes of its listing, with the stamp
    token it read before listing (records/index.py)."""
    return _listed_and_indexed_by_the_keeper(job, tier_name)[1]


def _listed_and_indexed_by_the_keeper(job: Job, tier_name: str) -> tuple[dict[str, SeenCopy], Index]:
    """The keeper's listing of ``tier_name`` (:func:`discover` with a cache of its own), and
    :func:`_index_as_the_keeper` of it."""
    from tierstore.promote.discovery import MarkerCache, discover, index_of
    from tierstore.records.changes import read_stamp
    from tierstore.records.conflicts import read_conflicts

    tier = make_tier(job.config.tier(tier_name), namespace=job.namespace, node=0)
    token = read_stamp(tier)
    records = read_conflicts(tier)
    found = discover(tier, MarkerCache(MarkerTrust()), records)
    return found, index_of(token, found, highest_in(tier), records)


@pytest.mark.slow  # ~15 s and ~65 s: jobs of 100 and 1,000 retained in four tiers, a lease waited out
@pytest.mark.parametrize("retained", [100, 1000])
def test_a_node_that_does_not_keep_a_job_wide_tier_reads_its_keepers_index_not_a_listing(
    counted_s3: CountingS3, file_ops: FileOps, tmp_path: Path, retained: int
) -> None:
    """Another node keeps the job-wide tiers (its leases renewed by the test). After a new commit in
    S3, this node's pass that learns the changed stamp (from the lease) lists nothing: while the
    keeper has not indexed the change it keeps its listing and reads the index again at the very
    next pass (not a lease later); once the index holds the stamp's token, the view is the index's,
    equal to a listing's. A few requests whatever is retained, where a listing costs pages."""
    from tierstore.promote.discovery import SETTLE
    from tierstore.records import lease
    from tierstore.records.changes import read_stamp

    job = Job(counted_s3, file_ops, tmp_path, f"index{retained}")  # its own leases
    job.populate(retained, 2)
    duration = 4.0
    config = job.config.model_copy(
        update={"promote": job.config.promote.model_copy(update={"keeper_lease": duration})}
    )
    elsewhere = lease.Holder(0, "another-host", "pidns", 1, "their-token", time.time())
    leases = {name: lease.Lease(1, elsewhere) for name in ("pfs", "s3")}
    tiers = {name: make_tier(job.config.tier(name), namespace=job.namespace, node=0) for name in leases}

    def renew_leases() -> None:  # the keeper on another host, alive: it names the stamp it read
        for name, held in leases.items():
            leases[name] = held.renewed(read_stamp(tiers[name]))
            lease.renew(tiers[name], leases[name])

    for name, held in leases.items():
        assert lease.claim(tiers[name], held)
    watcher = Promoter(config, node=1)

    watcher.run_once()  # lists every tier (no index yet), reads the leases: kept by another node
    renew_leases()  # before each pass: every read of the lease finds it renewed, never stale
    time.sleep(max(SETTLE + 0.1, duration))  # the lease is read once a lease: now, naming the stamp
    watcher.run_once()
    last_pass = time.monotonic()
    assert set(watcher.context.keepers.watched()) == {"pfs", "s3"}
    before = set(watcher.view.found["s3"])

    write_index(tiers["s3"], _index_as_the_keeper(job, "s3"))  # the keeper's, before the change
    protocol_save_into(job, "s3", retained + 1)  # a new commit, stamped
    # the keeper's next listing (a listing to compare the view with: nothing changes markers in S3
    # from here on), and its index of it, not written yet
    listed, index = _listed_and_indexed_by_the_keeper(job, "s3")
    time.sleep(max(0.0, last_pass + duration - time.monotonic()))  # the stamp is read once a lease
    renew_leases()
    with counted_s3.counting() as behind:
        watcher.run_once()
    assert set(watcher.view.found["s3"]) == before, "the kept listing, while the index is behind"
    with counted_s3.counting() as again:
        watcher.run_once()  # the next pass asks again: the index, and the stamp it is checked by
    write_index(tiers["s3"], index)
    with counted_s3.counting() as caught_up:
        watcher.run_once()
    assert set(watcher.context.keepers.watched()) == {"pfs", "s3"}, "still kept by another node"

    print(
        f"{retained} retained, a watcher's passes after a change in S3: {behind.by_operation},"
        f" {again.by_operation}, {caught_up.by_operation}"
    )
    for seen in (behind, again, caught_up):
        assert "GET list" not in seen.by_operation, seen.by_operation  # CountingS3's name of a LIST
    assert behind.total <= 3, behind.by_operation  # lease (naming the new stamp), index, stamp
    assert again.total == 2, again.by_operation  # index, stamp: no lease read
    assert caught_up.total == 1, caught_up.by_operation  # the index, under the lease's stamp
    found = watcher.view.found["s3"]
    assert {i: (s.copy.seq, s.copy.generation) for i, s in found.items()} == {
        i: (s.copy.seq, s.copy.generation) for i, s in listed.items()
    }
    assert len(found) == retained + 1
