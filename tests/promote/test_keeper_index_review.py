"""Adversarial checks of the keeper's index of a job-wide tier (records/index.py) and of the lease
naming its token as the tier's stamp (promote/keeper.py ``Keeper.indexed``): real promoters, each
a simulated node on a host of its own, over one shared POSIX tier."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.simulated_job import layout, manifest_for
from tierstore.config import Config, config_from_dict
from tierstore.promote.discovery import SETTLE
from tierstore.promote.sidecar import Promoter
from tierstore.records.changes import touch
from tierstore.records.index import read_index, write_index
from tierstore.records.known import list_commits
from tierstore.tiers import Tier
from tierstore.topology import HOST_VARIABLE

NAMESPACE = "job"
LEASE = 2.0
"""Seconds of the keeper's lease."""
FULL_SCAN = 1.0
"""Seconds after which a pass lists a tier whose stamp is unchanged: what bounds how long a change
goes unseen when nothing else tells."""


def _config(root: Path) -> Config:
    return config_from_dict(
        {
            "namespace": NAMESPACE,
            "promote": {"interval": "1s", "keeper_lease": f"{LEASE}s", "full_scan": f"{FULL_SCAN}s"},
            "tiers": [
                {"name": "ram", "type": "memory", "path": str(root / "ram" / "{node}")},
                {"name": "shared", "type": "shared", "path": str(root / "shared")},
            ],
        }
    )


def _promoter(config: Config, node: int, monkeypatch: pytest.MonkeyPatch) -> Promoter:
    """Node ``node``'s promoter, on a host of its own (one host would look like a restart)."""
    monkeypatch.setenv(HOST_VARIABLE, f"host{node}")
    return Promoter(config, node=node)


def _commit(tier: Tier, index: int) -> str:
    """A committed copy of checkpoint ``index`` in ``tier`` and the stamp after it, as another
    node's promotion leaves it; its id."""
    manifest = manifest_for(index, 1, NAMESPACE)
    for path, data in layout(manifest):
        tier.write_bytes(path, data)
    touch(tier)
    return manifest.checkpoint_id


def test_a_watcher_sees_a_stamped_change_within_a_full_scan_while_the_keepers_passes_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper's lease thread renews while its pass loop is busy (a long promotion): a change
    another node made and stamped since the keeper's last index must still reach a watcher
    within ``full_scan`` (and the leases it takes to read the lease), as without an index: the
    lease must not keep naming the old index's token as the tier's stamp for good."""
    config = _config(tmp_path)
    shared = config.make_tiers(node=0)[1]
    _commit(shared, 1)
    keeper, watcher = _promoter(config, 0, monkeypatch), _promoter(config, 1, monkeypatch)
    keeper.run_once()
    stop = keeper.context.keepers.start()
    try:
        keeper.run_once()  # its first pass restamped the tier: listed and indexed again
        watcher.run_once()
        time.sleep(LEASE)
        watcher.run_once()
        assert set(watcher.context.keepers.watched()) == {"shared"}, "node 0 keeps the tier"

        newest = _commit(shared, 2)  # stamped; the keeper's loop is busy from here on
        deadline = time.monotonic() + 3 * (LEASE + FULL_SCAN) + 2 * LEASE
        while newest not in watcher.view.found.get("shared", {}) and time.monotonic() < deadline:
            time.sleep(0.1)
            watcher.run_once()
        assert newest in watcher.view.found["shared"], "the watcher never saw the stamped change"
    finally:
        stop()


def test_a_start_up_look_names_a_marker_its_writer_died_before_stamping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promoter killed between its publish of a marker in the job-wide tier and that change's
    stamp leaves a committed id the stamp does not announce. A save's start-up look, which listed
    the markers, named it (rule 6: a save of that id without ``overwrite`` is refused)."""
    config = _config(tmp_path)
    shared = config.make_tiers(node=0)[1]
    _commit(shared, 1)
    keeper = _promoter(config, 0, monkeypatch)
    keeper.run_once()
    keeper.run_once()  # its first pass restamped the tier: listed and indexed under that stamp
    killed = manifest_for(2, 1, NAMESPACE)
    for path, data in layout(killed):  # files, marker, log entry; killed before its stamp
        shared.write_bytes(path, data)
    assert killed.checkpoint_id in list_commits(shared, config.marker_trust())[1]


def test_a_keeper_seeded_from_a_paused_predecessors_late_index_reads_the_marker_replaced_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeper A indexed the tier with every marker settled, then paused between its fence and its
    index write; meanwhile the id was overwritten (a new generation, stamped) and B took the lease
    over. A's late write puts its old index back: B's first look, seeded from it, must take the new
    generation from the marker, never the row A settled for the marker's earlier mtime."""
    config = _config(tmp_path)
    shared = config.make_tiers(node=0)[1]
    first = manifest_for(1, 1, NAMESPACE)
    _commit(shared, 1)
    a = _promoter(config, 0, monkeypatch)
    a.run_once()
    time.sleep(SETTLE + 0.1)  # its second pass reads the marker SETTLE s after the first listing showed it
    a.run_once()  # listed again (its first pass restamped): every marker read settled, and indexed
    late = read_index(shared)
    assert late is not None and [c.marker_mtime is not None for c in late.copies] == [True]
    a.context.keepers.release()  # (paused, it would be taken over three leases later: the same to B)

    again = manifest_for(2, 1, NAMESPACE)  # its generation's files, under the first one's id
    newer = again.with_changes(checkpoint_id=first.checkpoint_id)
    for path, data in layout(newer):  # the id saved again with overwrite, straight into the tier
        shared.write_bytes(path, data)
    touch(shared)
    write_index(shared, late)  # A resumes: its index, made before the overwrite, lands now

    b = _promoter(config, 1, monkeypatch)
    b.look()
    assert b.context.keepers.kept() == {"shared"}
    seen = b.view.found["shared"][first.checkpoint_id]
    assert (seen.copy.generation, seen.copy.seq) == (newer.generation, 2), "a row A settled for the old mtime"
    b.context.keepers.release()
