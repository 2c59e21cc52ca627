"""A job-wide tier that stops answering in the middle of a promoter's pass, for real: the pass's look
saw it reachable, then its mount hangs (a Lustre or NFS hard mount whose server went away; here a
FUSE filesystem that answers nothing, ``tests/hung_files.hung_mount``, put over it), or its S3
endpoint accepts and never answers (moto behind ``tests/fault_proxy.FaultProxy`` in ``hang``).

``tierstore promote`` runs in its own process, memory -> local -> shared. A kill point with
``SIGSTOP`` (:mod:`tierstore._platform.killpoints`) holds it at the step where the hang begins (a
promotion into the shared tier has written its first chunk; retention has withdrawn a marker there),
the shared tier starts hanging, and the promoter goes on (``SIGCONT``). The pass gives the hung
tier one ``probe_timeout`` without progress and ends; the promoter names the tier, promotes a later
checkpoint from host memory to the node's disk while the shared tier hangs, and stops on ``SIGTERM``
within its grace period. Before: the pass never ended, nothing was promoted any more, and ``SIGTERM``
did not stop it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.fault_proxy import FaultProxy
from tests.guarantees.test_tier_health import ROOT
from tests.hung_files import hung_mount, hung_mount_unavailable
from tierstore import TieredWriter, load_config
from tierstore._platform import health
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.tiers import make_tier

PROBE_TIMEOUT = 2.0
GRACE = 3.0
WORK = 4.0
"""Seconds the rest of a pass may take on a loaded two-core machine (local files only)."""
needs_fuse = pytest.mark.skipif(bool(hung_mount_unavailable()), reason=hung_mount_unavailable() or "")


@contextlib.contextmanager
def shared_tier(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The shared tier's YAML entry, and a context in which it hangs: a ``shared`` tier under
    ``tmp_path/mnt`` (the hung mount goes there), or an ``s3`` tier whose client would wait 30 s
    twice for an answer (the proxy hangs)."""
    if kind == "mount":
        if hung_mount_unavailable():
            pytest.skip(hung_mount_unavailable() or "")
        spec = {"name": "shared", "type": "shared", "path": str(tmp_path / "mnt" / "ckpt")}
        yield spec, lambda: hung_mount(tmp_path / "mnt")
        return
    upstream = urlparse(request.getfixturevalue("s3_endpoint"))
    assert upstream.hostname is not None and upstream.port is not None
    with FaultProxy(upstream.hostname, upstream.port) as proxy:
        url = f"s3://{request.getfixturevalue('s3_bucket')}/run"
        spec = {"name": "shared", "type": "s3", "url": url, "endpoint_url": proxy.endpoint}
        spec |= {"max_attempts": 2, "read_timeout": "30s"}

        @contextlib.contextmanager
        def hanging() -> Iterator[None]:
            proxy.set_mode("hang")
            yield

        yield spec, hanging


def write_config(tmp_path: Path, shared: dict[str, Any], keep: int = 10) -> Path:
    """ram -> local -> ``shared``, each keeping ``keep``, a short ``probe_timeout``; the YAML's path."""
    path = tmp_path / "tierstore.yaml"
    tiers = [
        {"name": "ram", "type": "memory", "path": str(tmp_path / "ram"), "keep": keep},
        {"name": "local", "type": "local", "path": str(tmp_path / "local"), "keep": keep},
        {**shared, "keep": keep},
    ]
    promote = {"interval": "0.5s", "grace_period": f"{GRACE}s"}
    path.write_text(
        yaml.safe_dump({"tiers": tiers, "probe_timeout": f"{PROBE_TIMEOUT}s", "promote": promote})
    )
    return path


def save(config: Config, step: int) -> None:
    state = {"w": torch.full((1000,), float(step)), "step": step}
    dcp.save(state, storage_writer=TieredWriter(config), checkpoint_id=f"step_{step:04d}")


def committed(config: Config, tier_name: str, step: int) -> bool:
    tier = make_tier(config.tier(tier_name), namespace=config.namespace, node=0)
    return tier.exists(marker_path(f"step_{step:04d}"))


def within(seconds: float, done: Callable[[], bool]) -> float | None:
    """Seconds until ``done()``, polled; None if not within ``seconds``."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if done():
            return time.monotonic() - began
        time.sleep(0.05)
    return None


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (its kill point's SIGSTOP)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("kind", ["mount", "s3"])
@pytest.mark.parametrize(
    "case",
    [
        # the first promotion local -> shared wrote its first chunk (the first two reaches are
        # ram -> local's); the second one waits behind it
        pytest.param(("promote.mid_copy@.metadata:3", 2, 10), id="promotion"),
        # retention withdrew the marker of step 1 in shared (after ram's and local's), before its
        # log entry, parts and data; every tier held steps 1 and 2 (a promoter before, keeping all)
        pytest.param(("drop.marker_withdrawn@step_0001:3", 2, 1), id="retention"),
    ],
)
def test_a_tier_that_hangs_mid_pass_costs_the_pass_one_probe_timeout(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str, case: tuple[str, int, int]
) -> None:
    """The pass ends within ``probe_timeout`` and its own work after the hang begins, the log
    names the tier, a later checkpoint goes ram -> local while the shared tier hangs, and SIGTERM
    stops the promoter within its grace period (exit 0). ``case``: the kill point where the hang
    begins, the checkpoints saved before, what each tier keeps."""
    point, saved, keep = case
    with shared_tier(kind, tmp_path, request) as (shared, hanging):
        config = load_config(write_config(tmp_path, shared))
        for step in range(1, saved + 1):
            save(config, step)
        if keep < saved:
            assert Promoter(config, node=0).run(once=True) == 0  # its lease given up: the child keeps it
        config_path = write_config(tmp_path, shared, keep)
        config = load_config(config_path)
        log = tmp_path / "promoter.log"
        argv = [sys.executable, "-m", "tierstore.cli", "--config", str(config_path), "-v", "promote"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERSTORE_KILL_POINT": point}
        with log.open("w") as out:
            env["TIERSTORE_KILL_SIGNAL"] = "SIGSTOP"
            promoter = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            promoted_while_hung(promoter, log, config, hanging, saved=saved, keep=keep)
        finally:
            if promoter.poll() is None:
                promoter.kill()
                promoter.wait()


def promoted_while_hung(
    promoter: subprocess.Popen[bytes], log: Path, config: Config, hanging: Any, *, saved: int, keep: int
) -> None:
    """The assertions of the test above, on the promoter held at its kill point."""
    said = log.read_text
    promoting = keep >= saved  # the hang begins in a promotion, else in retention
    assert within(60, lambda: "kill point" in said() and stopped(promoter.pid)) is not None, said()
    # promotion: ram -> local was done; retention: local's step 1 went before the shared tier's
    assert committed(config, "local", 1) == promoting, said()
    with hanging():
        promoter.send_signal(signal.SIGCONT)
        passed = within(PROBE_TIMEOUT + WORK + 10, lambda: "pass: " in said())
        print(f"the pass ended {passed} s after the shared tier hung")
        assert passed is not None and passed < PROBE_TIMEOUT + WORK, f"pass not over: {said()[-3000:]}"
        assert "tier shared is unreachable" in said(), said()[-3000:]
        failed = said().count("promotion_failed")
        assert failed == (1 if promoting else 0), said()[-3000:]  # once, not once per copy waiting
        save(config, saved + 1)  # this process's writer gives the shared tier one probe_timeout at most
        promoted = within(2 * PROBE_TIMEOUT + WORK, lambda: committed(config, "local", saved + 1))
        print(f"step {saved + 1}: ram -> local {promoted} s after its save")
        assert promoted is not None, f"not promoted while the shared tier hangs: {said()[-3000:]}"
        promoter.send_signal(signal.SIGTERM)
        exited = within(GRACE, lambda: promoter.poll() is not None)
        print(f"exited ({promoter.returncode}) {exited} s after SIGTERM")
        assert exited is not None and promoter.returncode == 0, said()[-3000:]


@needs_fuse
def test_gc_gives_a_node_local_tier_that_hangs_after_the_look_one_probe_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Cleanup looks at each tier afresh (every file, the activity records, the markers), and no
    lease is asked first of a node-local tier: the node's disk hangs after the pass's look, and
    ``gc`` gives it one ``probe_timeout`` and names it. Before: ``gc`` never returned."""
    shared = {"name": "shared", "type": "shared", "path": str(tmp_path / "shared")}
    config = load_config(write_config(tmp_path, shared))
    save(config, 1)
    promoter = Promoter(config, node=0)
    promoter.look()
    local = promoter.by_name["local"]
    assert "local" in promoter.view.found
    with hung_mount(tmp_path / "local"):
        began = time.monotonic()
        gc = threading.Thread(target=lambda: promoter.collect_garbage(dry_run=True), daemon=True)
        gc.start()
        gc.join(PROBE_TIMEOUT + WORK)
        took = time.monotonic() - began
        print(f"gc returned: {not gc.is_alive()}, after {took:.1f} s")
        assert not gc.is_alive(), f"gc still waits for the hung tier after {took:.1f} s"
        assert health.view().is_open(local)
        assert any("tier local is unreachable" in r.getMessage() for r in caplog.records), caplog.text
