"""S3 faults on the real server: promotion and restore through a flaky store, SeaweedFS behind the
loopback HTTP fault proxy (``tests/http_faults.py``). Nothing in tierstore is patched.

* At 10-30 % of requests broken (503 SlowDown, 500 after the work was done, a reset mid-body, a
  truncated body, an answer slower than the read timeout, a flipped byte in an upload or in an
  object's body), promotion memory -> S3 and a restore from S3 alone complete, and the restore is
  bit-exact (a digest of every tensor's bytes and every non-tensor item). Each case prints its seed.
* At 100 %, promotion and restore fail after bounded retries, in bounded time, with an error naming
  the tier, the object and the attempts; the previous durable checkpoint stays the latest and
  restores exactly, and nothing partial is listed.
* A flipped byte is never taken silently: an upload's is refused by the store's checksum and sent
  again; a whole object's (a marker) by the checksum the store sends with it; a ranged GET's (the
  tensor data of a restore, sent without a checksum) by the item's CRC32C: read again, and if it
  stays wrong the restore fails naming tier and object.
* Two promoters racing to publish one marker: exactly one marker, and the loser says another won.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.http_faults import FAULTS, Fault, HttpFaultProxy
from tests.s3server import SeaweedServer
from tests.seeds import fault_seeds
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore._platform import health
from tierstore.config import Config, config_from_dict
from tierstore.promote.sidecar import Promoter
from tierstore.records.catalog import Catalog

RATES = (0.2, 0.3, 0.1)
MIXES: tuple[tuple[Fault, ...], ...] = (FAULTS, *((fault,) for fault in FAULTS))
"""Seed n breaks ``RATES[n % 3]`` of the requests by the faults ``MIXES[n // 3 % 8]``: every fault
at once first (make test runs seed 0: all of them at 20 %), then each alone; 24 seeds cover every
mix at every rate."""
READ_TIMEOUT_S = 1.5
PASSES = 6
"""Promoter passes a flaky store may take (a pass whose copy failed is redone by the next)."""


@pytest.fixture
def flaky_s3(seaweed: SeaweedServer, seaweed_bucket: str) -> Iterator[tuple[HttpFaultProxy, str]]:
    """``(proxy, bucket)``: the fault proxy in front of SeaweedFS, healthy until configured."""
    endpoint = urlparse(seaweed.endpoint)
    assert endpoint.hostname is not None and endpoint.port is not None
    proxy = HttpFaultProxy(endpoint.hostname, endpoint.port, slow_s=READ_TIMEOUT_S + 1.5)
    with proxy:
        yield proxy, seaweed_bucket


def s3_tier(proxy: HttpFaultProxy, bucket: str, *, attempts: int) -> dict[str, Any]:
    return {
        "name": "s3",
        "type": "s3",
        "url": f"s3://{bucket}/run",
        "endpoint_url": proxy.endpoint,
        "max_attempts": attempts,
        "max_retry_time": "20s",
        "read_timeout": f"{READ_TIMEOUT_S}s",
        "part_size": "5MiB",
        "concurrency": 4,
    }


def configs(
    tmp_path: Path, proxy: HttpFaultProxy, bucket: str, *, attempts: int, stale_after: str = "1h"
) -> tuple[Config, Config]:
    """``(memory -> s3, s3 alone)``: the job's tiers, and a restart that has only S3."""
    s3 = s3_tier(proxy, bucket, attempts=attempts)
    ram = {"name": "ram", "type": "memory", "path": str(tmp_path / "ram"), "keep": 4}
    promote = {"interval": "1s", "stale_after": stale_after, "activity_ttl": "1s"}
    common = {"probe_timeout": "20s", "promote": promote}
    return (config_from_dict({"tiers": [ram, s3], **common}), config_from_dict({"tiers": [s3], **common}))


def state_at(step: int, mib: int = 11) -> dict[str, Any]:
    """``mib`` MiB of float32 (11: a multipart upload of 3 parts), a small tensor and non-tensor
    items, all drawn from ``step``."""
    generator = torch.Generator().manual_seed(step)
    return {
        "big": torch.rand(mib * 2**18, generator=generator),
        "small": torch.randint(0, 1000, (300,), generator=generator),
        "extra": {"step": step, "note": f"saved at step {step}", "lr": 0.1 / (step + 1)},
    }


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "big": torch.zeros_like(state["big"]),
        "small": torch.zeros_like(state["small"]),
        "extra": {"step": -1, "note": "", "lr": 0.0},
    }


def digest(state: dict[str, Any]) -> str:
    """Every tensor's bytes and every non-tensor item."""
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if isinstance(value, torch.Tensor):
            h.update(name.encode() + value.contiguous().numpy().tobytes())
        else:
            h.update(name.encode() + repr(sorted(value.items())).encode())
    return h.hexdigest()


def save(config: Config, step: int, mib: int = 11) -> None:
    dcp.save(state_at(step, mib), storage_writer=TieredWriter(config), checkpoint_id=f"step_{step:04d}")


def restore(config: Config, step: int, mib: int = 11) -> str:
    """The digest of what a restore of ``step`` loads (from S3: the config has no other tier)."""
    target = empty_like(state_at(step, mib))
    reader = TieredReader(config)
    dcp.load(target, storage_reader=reader, checkpoint_id=f"step_{step:04d}")
    assert reader.chosen_tier == "s3"
    return digest(target)


def committed_in_s3(config: Config) -> list[str]:
    tier = config.make_tier("s3", node=0)
    return sorted(c for c in tier.list_dir("") if tier.exists(f"{c}/commit.json"))


def promote_until(config: Config, wanted: list[str]) -> tuple[int, float]:
    """Run promoter passes until S3 commits ``wanted`` (at most :data:`PASSES`): (passes, retries)."""
    promoter = Promoter(config)
    passes = 0
    while passes < PASSES:
        passes += 1
        promoter.run_once()
        if committed_in_s3(config) == wanted:
            break
    retries = promoter.metrics.registry.get_sample_value("tierstore_retries_total", {"tier": "s3"})
    return passes, retries or 0.0


def retried(caplog: pytest.LogCaptureFixture) -> int:
    return sum(
        r.getMessage().startswith("retrying ") for r in caplog.records if r.name == "tierstore.tiers.s3.retry"
    )


@pytest.mark.faults
@pytest.mark.parametrize("seed", fault_seeds(1))
def test_promotion_and_restore_survive_a_flaky_store(
    seed: int, tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, bucket = flaky_s3
    rate, faults = RATES[seed % len(RATES)], MIXES[seed // len(RATES) % len(MIXES)]
    mix = "all" if len(faults) > 1 else faults[0]
    print(f"seed={seed} rate={rate} faults={mix}")
    job, restart = configs(tmp_path, proxy, bucket, attempts=8)
    proxy.configure(rate=rate, faults=faults, seed=seed)
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    for step in (1, 2):
        save(job, step)
    passes, promote_retries = promote_until(job, ["step_0001", "step_0002"])
    assert committed_in_s3(job) == ["step_0001", "step_0002"], f"seed {seed}: not promoted"
    caplog.clear()
    assert latest_committed(restart, collective=False) == "step_0002"
    assert restore(restart, 2) == digest(state_at(2)), f"seed {seed}: not bit-exact"
    print(
        f"seed={seed} rate={rate} faults={mix} requests={proxy.requests} injected={dict(proxy.injected)}"
        f" promoter_passes={passes} promoter_retries={promote_retries:.0f}"
        f" restore_retries={retried(caplog)} seconds={time.monotonic() - started:.1f}"
    )
    if mix == "all":  # one fault alone may find no request it applies to at a low rate
        assert sum(proxy.injected.values()) > 0, "the proxy broke some requests"


FAIL_ATTEMPTS = 3
FAIL_FAULTS: tuple[Fault, ...] = ("503", "reset", "slow", "flip_request")
"""Each breaks every write of a new checkpoint in turn (500 and truncate fail as 503 and reset do)."""


def only_writes_of(checkpoint_id: str) -> Callable[[str, str], bool]:
    """The requests that write ``checkpoint_id``'s data: the store answers everything else."""
    return lambda method, path: method in ("PUT", "POST") and f"/{checkpoint_id}/" in path


def test_a_store_that_always_fails_fails_bounded_and_keeps_the_last_durable_copy(
    tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, bucket = flaky_s3
    job, restart = configs(tmp_path, proxy, bucket, attempts=FAIL_ATTEMPTS)
    s3 = restart.make_tier("s3", node=0)
    save(job, 1)
    promote_until(job, ["step_0001"])
    assert committed_in_s3(job) == ["step_0001"]
    save(job, 2)
    orphans: dict[str, int] = {}
    for fault in FAIL_FAULTS:
        # Each fault meets a promoter on a node of its own: the previous fault's outage opened S3's
        # breaker for this process and this node (the health view), which skips it for a period
        monkeypatch.setenv("TIERSTORE_HEALTH_DIR", str(tmp_path / f"verdicts-{fault}"))
        health.view()._forget()
        proxy.configure(rate=1.0, faults=[fault], only=only_writes_of("step_0002"))
        started = time.monotonic()
        report = Promoter(job).run_once()
        seconds = time.monotonic() - started
        failed = {p.checkpoint_id: why for p, why in report.failed}
        assert list(failed) == ["step_0002"], f"{fault}: {report}"
        why = failed["step_0002"]
        print(f"fault={fault}: the promoter's pass failed after {seconds:.1f} s: {why}")
        assert why.startswith("tier s3 (s3, s3://"), why
        key = r"(put|start upload|part \d+ of) run/step_0002/\S+"  # the object, by its key
        assert re.search(rf"{key}: .*\({FAIL_ATTEMPTS} attempts in [\d.]+ s\)", why), why
        assert "max_attempts" in why, "the error says what to change"
        bound = FAIL_ATTEMPTS * (READ_TIMEOUT_S + 2 + 10) + 10  # timeouts, 100-continue, waits
        assert seconds < bound, f"{fault}: {seconds:.1f} s: retries are bounded in time"
        proxy.configure(rate=0.0)
        # An upload the promoter knew of is aborted. One whose CreateMultipartUpload answer was
        # lost (reset, slow) is unknown to it, so it stays until gc finds it stale (below).
        left = len(s3.incomplete_writes(idle_for=0, now=time.time() + 5)) - sum(orphans.values())
        assert left == 0 or fault in ("reset", "slow"), f"{fault}: {left} uploads left"
        orphans[fault] = left
    # The previous durable checkpoint is still the latest and exact; nothing partial is listed (the
    # restart is a process on a node of its own, as above).
    monkeypatch.setenv("TIERSTORE_HEALTH_DIR", str(tmp_path / "verdicts-restart"))
    health.view()._forget()
    assert committed_in_s3(job) == ["step_0001"]
    assert latest_committed(restart, collective=False) == "step_0001"
    assert [e.checkpoint_id for e in Catalog(restart).listings()] == ["step_0001"]
    assert restore(restart, 1) == digest(state_at(1))
    time.sleep(2.5)  # stale_after 1 s, on the store's clock (whole seconds)
    gc_config = configs(tmp_path, proxy, bucket, attempts=FAIL_ATTEMPTS, stale_after="1s")[0]
    Promoter(gc_config).collect_garbage(dry_run=False)
    assert s3.incomplete_writes(idle_for=0, now=time.time() + 5) == [], "gc left an upload"
    print(f"orphaned uploads by fault {orphans}; after gc: 0")
    # Every read fails: the restore says which object, and after how many attempts.
    proxy.configure(rate=1.0, faults=["503"], only=lambda method, _path: method == "GET")
    started = time.monotonic()
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        restore(restart, 1)
    seconds, message = time.monotonic() - started, str(caught.value)
    print(f"the restore failed after {seconds:.1f} s: {message.splitlines()[-1]}")
    assert "tier s3" in message and "step_0001" in message, message
    assert f"{FAIL_ATTEMPTS} attempts" in message, message
    assert seconds < 60


@pytest.mark.parametrize("fault", ["flip_request", "flip_response"])
def test_a_flipped_byte_is_caught_and_fetched_or_sent_again(
    fault: Fault, tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Every upload (``flip_request``) or every whole-object read (``flip_response``: markers,
    ``.metadata``) is damaged once in two: never stored nor taken as it is, always retried."""
    proxy, bucket = flaky_s3
    job, _restart = configs(tmp_path, proxy, bucket, attempts=8)
    s3 = job.make_tier("s3", node=0)
    caplog.set_level(logging.DEBUG, logger="tierstore.tiers.s3.retry")
    body = bytes(range(256)) * 40
    if fault == "flip_request":
        proxy.configure(rate=0.5, faults=[fault], seed=1)
        for number in range(10):
            s3.publish(f"flip/{number}.json", body, create_only=True)
        proxy.configure(rate=0.0)
        assert all(s3.read_bytes(f"flip/{n}.json") == body for n in range(10))
    else:
        for number in range(10):
            s3.publish(f"flip/{number}.json", body, create_only=True)
        proxy.configure(rate=0.5, faults=[fault], seed=1)
        assert all(s3.read_bytes(f"flip/{n}.json") == body for n in range(10))
    assert proxy.injected[fault] > 0
    assert retried(caplog) >= proxy.injected[fault], "each damaged body was caught and retried"
    print(f"{fault}: injected {proxy.injected[fault]}, retried {retried(caplog)}")


RACES = 3


def test_two_promoters_racing_on_one_marker_commit_it_once(
    tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, bucket = flaky_s3
    job, _restart = configs(tmp_path, proxy, bucket, attempts=8)
    caplog.set_level(logging.INFO, logger="tierstore.promote.sidecar")
    s3 = job.make_tier("s3", node=0)
    refereed = 0
    for race in range(RACES):
        checkpoint_id = f"step_{race + 1:04d}"
        save(job, race + 1, mib=1)  # the race is over the marker: little data
        promoters = [Promoter(job), Promoter(job)]
        for promoter in promoters:  # the leases settled first (through the flaky proxy, retried):
            promoter.context.keepers.tick()  # the race below is over the marker, started together
        barrier = threading.Barrier(2)
        reports: list[Any] = [None, None]
        threads = [threading.Thread(target=_race, args=(barrier, promoters[i], reports, i)) for i in (0, 1)]
        caplog.clear()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        won = [checkpoint_id in [p.checkpoint_id for p in r.promoted] for r in reports]
        assert sorted(won) == [False, True], f"race {race}: exactly one promoter commits"
        assert all(not r.failed for r in reports), f"race {race}: nobody fails"
        markers = [f for f in s3.find(checkpoint_id) if f.path.endswith("/commit.json")]
        assert [f.path for f in markers] == [f"{checkpoint_id}/commit.json"]
        skipped = [r.getMessage() for r in caplog.records if "promotion_skipped" in r.getMessage()]
        assert any(checkpoint_id in m and "already holds this commit" in m for m in skipped), (
            f"race {race}: the loser says another promoter won: {skipped}"
        )
        marker_puts = proxy.seen[f"PUT /{bucket}/run/{checkpoint_id}/commit.json"]
        refereed += marker_puts == 2  # else the loser saw the marker before its own PUT
    print(f"{RACES} races, one marker each; both promoters PUT the marker in {refereed}")


def _race(barrier: threading.Barrier, promoter: Promoter, reports: list[Any], index: int) -> None:
    """One promoter's pass, started with the other's (the barrier releases both at once)."""
    barrier.wait()
    reports[index] = promoter.run_once()


def test_a_flipped_byte_in_a_ranged_read_is_never_loaded_silently(
    tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str]
) -> None:
    """Every ranged GET (the tensor data of a restore) comes back with one byte flipped: the
    restore must fail, naming tier and file, or retry until the bytes are right."""
    proxy, bucket = flaky_s3
    job, restart = configs(tmp_path, proxy, bucket, attempts=FAIL_ATTEMPTS)
    save(job, 1, mib=1)
    promote_until(job, ["step_0001"])
    proxy.configure(rate=1.0, faults=["flip_range"], only=lambda method, _path: method == "GET")
    try:
        restored = restore(restart, 1, mib=1)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        assert "tier s3" in str(exc) and "step_0001" in str(exc), exc
        return
    assert proxy.injected["flip_range"] > 0
    assert restored == digest(state_at(1, mib=1)), "a byte flipped in transit was loaded silently"


def test_a_byte_flipped_once_in_a_ranged_read_is_read_again(
    tmp_path: Path, flaky_s3: tuple[HttpFaultProxy, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The first ranged GET of the restore comes back with one byte flipped, the next ones intact:
    the item's CRC32C catches it, the range is read again, and the restore is bit-exact."""
    proxy, bucket = flaky_s3
    job, restart = configs(tmp_path, proxy, bucket, attempts=FAIL_ATTEMPTS)
    save(job, 1, mib=1)
    promote_until(job, ["step_0001"])

    def first_get_only(method: str, _path: str) -> bool:
        return method == "GET" and not proxy.injected["flip_range"]

    proxy.configure(rate=1.0, faults=["flip_range"], only=first_get_only)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        restored = restore(restart, 1, mib=1)
    assert proxy.injected["flip_range"] >= 1
    assert restored == digest(state_at(1, mib=1)), "the flipped range was loaded"
    assert any(
        "do not match their CRC32C" in r.getMessage() and "tier s3" in r.getMessage() for r in caplog.records
    ), "the mismatch is logged with its tier"
