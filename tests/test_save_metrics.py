"""Trainer-side metrics: what a save records in its rank's file, and how the node's promoter serves the
files of several ranks on its ``/metrics`` (one scrape target per node)."""

from __future__ import annotations

import logging
import os
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.workers import run_ranks
from tierstore import TieredWriter
from tierstore._platform.save_metrics import (
    FAMILIES,
    SAMPLE_NAMES,
    SaveRecorder,
    rank_file,
    read_directory,
    read_values,
)
from tierstore.config import Config, config_from_dict
from tierstore.errors import ConfigError
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def series(text: str) -> Series:
    """Every sample of a Prometheus exposition, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Series, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def of_rank(directory: Path, rank: int) -> Series:
    return series((directory / rank_file(rank)).read_text())


def scrape(port: int) -> Series:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return series(response.read().decode())


# -- the recorder ----------------------------------------------------------------------------------


def test_a_staged_save_records_its_stall_write_and_bytes(tmp_path: Path) -> None:
    recorder = SaveRecorder(str(tmp_path))
    recorder.staged(0.25, 0.05)
    recorder.written(3, "ram", nbytes=1000, write_s=0.5, save_s=2.0)
    found = of_rank(tmp_path, 3)
    at = {"rank": "3", "tier": "ram"}
    assert value(found, "tierstore_save_last_stall_seconds", **at) == 0.25  # the stage's, not 2.0
    assert value(found, "tierstore_save_last_wait_seconds", **at) == 0.05
    assert value(found, "tierstore_save_stall_seconds_count", **at) == 1
    assert value(found, "tierstore_save_stall_seconds_sum", **at) == 0.25
    assert value(found, "tierstore_save_last_write_seconds", **at) == 0.5
    assert value(found, "tierstore_save_written_bytes_total", **at) == 1000
    assert value(found, "tierstore_saves_written_total", **at) == 1
    assert value(found, "tierstore_save_last_written_timestamp_seconds", **at) == pytest.approx(
        time.time(), abs=60
    )
    # not the coordinator's: no commit series, and nothing failed
    assert value(found, "tierstore_saves_committed_total", **at) is None
    assert value(found, "tierstore_saves_failed_total", **at) is None


def test_an_unstaged_save_stalls_for_all_of_it_and_counters_add_up(tmp_path: Path) -> None:
    recorder = SaveRecorder(str(tmp_path))
    recorder.written(0, "ram", nbytes=10, write_s=0.5, save_s=0.75)  # dcp.save: never staged
    recorder.staged(0.125, None)
    recorder.written(0, "ram", nbytes=20, write_s=0.25, save_s=1.0)
    recorder.committed(0, "ram", commit_s=1.5)
    recorder.written(0, "disk", nbytes=5, write_s=0.1, save_s=0.2)
    found = of_rank(tmp_path, 0)
    ram = {"rank": "0", "tier": "ram"}
    assert value(found, "tierstore_save_stall_seconds_count", **ram) == 2
    assert value(found, "tierstore_save_stall_seconds_sum", **ram) == 0.875
    assert value(found, "tierstore_save_last_stall_seconds", **ram) == 0.125
    assert value(found, "tierstore_save_write_seconds_sum", **ram) == 0.75
    assert value(found, "tierstore_save_written_bytes_total", **ram) == 30
    assert value(found, "tierstore_saves_written_total", **ram) == 2
    assert value(found, "tierstore_saves_committed_total", **ram) == 1
    assert value(found, "tierstore_save_last_commit_seconds", **ram) == 1.5
    assert value(found, "tierstore_save_commit_seconds_count", **ram) == 1
    assert value(found, "tierstore_save_written_bytes_total", rank="0", tier="disk") == 5


def test_a_restarted_rank_goes_on_counting_from_its_file(tmp_path: Path) -> None:
    SaveRecorder(str(tmp_path)).written(1, "ram", nbytes=100, write_s=1.0, save_s=1.0)
    restarted = SaveRecorder(str(tmp_path))  # a new process, same rank
    restarted.failed(1, "ram", save_s=0.5)
    restarted.written(1, "ram", nbytes=50, write_s=1.0, save_s=1.0)
    found = of_rank(tmp_path, 1)
    at = {"rank": "1", "tier": "ram"}
    assert value(found, "tierstore_saves_written_total", **at) == 2
    assert value(found, "tierstore_saves_failed_total", **at) == 1
    assert value(found, "tierstore_save_written_bytes_total", **at) == 150
    assert value(found, "tierstore_save_stall_seconds_count", **at) == 3  # a failed save stalls too


def test_a_file_is_replaced_whole_and_holds_only_its_rank(tmp_path: Path) -> None:
    SaveRecorder(str(tmp_path)).written(2, "ram", nbytes=1, write_s=0.1, save_s=0.1)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["rank-00002.prom"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert read_values(str(tmp_path / rank_file(2)), 5) == {}  # another rank's series are not its


def test_recording_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    recorder = SaveRecorder(str(blocked / "metrics"))  # a directory that cannot be made
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.save_metrics"):
        recorder.written(0, "ram", nbytes=1, write_s=0.1, save_s=0.1)
        recorder.committed(0, "ram", commit_s=0.2)
    warnings = [r for r in caplog.records if "cannot record save metrics" in r.getMessage()]
    assert len(warnings) == 1  # once, then quiet
    SaveRecorder(None).written(0, "ram", nbytes=1, write_s=0.1, save_s=0.1)  # off: a no-op


def test_a_file_that_is_not_prometheus_text_starts_over(tmp_path: Path) -> None:
    (tmp_path / rank_file(0)).write_text("garbage {{{\n")
    SaveRecorder(str(tmp_path)).written(0, "ram", nbytes=7, write_s=0.1, save_s=0.1)
    at = {"rank": "0", "tier": "ram"}
    assert value(of_rank(tmp_path, 0), "tierstore_save_written_bytes_total", **at) == 7


def test_every_family_renders_with_the_names_declared(tmp_path: Path) -> None:
    recorder = SaveRecorder(str(tmp_path))
    recorder.staged(0.1, 0.01)
    recorder.written(0, "ram", nbytes=1, write_s=0.1, save_s=0.1)
    recorder.committed(0, "ram", commit_s=0.2)
    recorder.failed(0, "ram")
    found = {name for name, _labels in of_rank(tmp_path, 0)}
    assert found == SAMPLE_NAMES
    assert {f.kind for f in FAMILIES} == {"counter", "gauge", "summary"}


# -- the promoter serves every rank's file ---------------------------------------------------------


def test_the_promoter_serves_two_ranks_as_separate_series(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    from tierstore.promote.sidecar import Promoter

    metrics = tmp_path / "metrics" / "{node}"
    config = make_config("memory", "local", metrics={"directory": str(metrics)})
    here = Path(str(metrics).replace("{node}", "0"))
    first, second = SaveRecorder(str(here)), SaveRecorder(str(here))
    first.staged(0.5, None)
    first.written(0, "memory", nbytes=4096, write_s=1.0, save_s=1.0)
    first.committed(0, "memory", commit_s=2.5)
    second.staged(0.75, None)
    second.written(1, "memory", nbytes=8192, write_s=1.25, save_s=1.0)
    promoter = Promoter(config, node=0)
    promoter.run_once()
    found = scrape(promoter.serve(0, "127.0.0.1"))
    for rank, stall, nbytes in (("0", 0.5, 4096), ("1", 0.75, 8192)):
        at = {"rank": rank, "tier": "memory"}
        assert value(found, "tierstore_save_last_stall_seconds", **at) == stall
        assert value(found, "tierstore_save_written_bytes_total", **at) == nbytes
        assert value(found, "tierstore_saves_written_total", **at) == 1
    assert value(found, "tierstore_saves_committed_total", rank="0", tier="memory") == 1
    assert value(found, "tierstore_saves_committed_total", rank="1", tier="memory") is None
    # the promoter's own metrics and its health are still there
    assert value(found, "tierstore_promoter_live") == 1
    assert value(found, "tierstore_promoter_ready") == 1
    assert value(found, "tierstore_promoter_passes_total") == 1
    assert value(found, "tierstore_promoter_failed_passes_total") == 0
    assert value(found, "tierstore_tier_unavailable", tier="local") == 0
    # a new save is seen at the next scrape, without a restart
    second.written(1, "memory", nbytes=8, write_s=0.1, save_s=0.1)
    again = scrape(promoter.metrics.serve(0, "127.0.0.1"))
    assert value(again, "tierstore_save_written_bytes_total", rank="1", tier="memory") == 8200


def test_stale_broken_and_clashing_files_are_left_out(tmp_path: Path) -> None:
    from tierstore.promote.health import PromoterHealth
    from tierstore.promote.metrics import PromoterMetrics

    SaveRecorder(str(tmp_path)).written(0, "ram", nbytes=1, write_s=0.1, save_s=0.1)
    SaveRecorder(str(tmp_path)).written(7, "ram", nbytes=2, write_s=0.1, save_s=0.1)
    day_ago = time.time() - 86400 - 60
    os.utime(tmp_path / rank_file(7), (day_ago, day_ago))  # a rank of an earlier, larger job
    (tmp_path / "broken.prom").write_text("not {{ prometheus\n")
    (tmp_path / "shadow.prom").write_text(
        '# TYPE tierstore_tier_unavailable gauge\ntierstore_tier_unavailable{tier="x"} 1\n'
    )
    (tmp_path / "drill.prom").write_text('tierstore_drill_success{tier="s3"} 1\n')
    metrics = PromoterMetrics()
    metrics.watch(PromoterHealth(300.0), str(tmp_path), stale_after=86400.0)
    found = scrape(metrics.serve(0, "127.0.0.1"))
    assert value(found, "tierstore_saves_written_total", rank="0", tier="ram") == 1
    assert value(found, "tierstore_saves_written_total", rank="7", tier="ram") is None
    assert value(found, "tierstore_tier_unavailable", tier="x") is None  # the promoter's own name
    assert value(found, "tierstore_drill_success", tier="s3") == 1  # a textfile beside: served
    everything = read_directory(str(tmp_path))  # stale_after 0: no age limit
    ranks = {s.labels.get("rank") for m in everything for s in m.samples}
    assert {"0", "7"} <= ranks


def test_watching_again_replaces_the_collectors(tmp_path: Path) -> None:
    from tierstore.promote.health import PromoterHealth
    from tierstore.promote.metrics import PromoterMetrics

    metrics = PromoterMetrics()
    metrics.watch(PromoterHealth(300.0), str(tmp_path))
    health = PromoterHealth(300.0)
    health.pass_failed("cannot list")
    metrics.watch(health, None)
    assert metrics.registry.get_sample_value("tierstore_promoter_failed_passes_total") == 1


# -- the writer records what a save did -------------------------------------------------------------


def rank_bytes(config: Config, checkpoint_id: str) -> int:
    tier = config.make_tier(config.tiers[0].name, node=0)
    manifest = read_manifest(tier, checkpoint_id, trust=MarkerTrust())
    return sum(f.size for f in manifest.files if f.rank is not None)


def test_a_save_through_the_writer_records_stall_commit_and_bytes(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    metrics = tmp_path / "metrics"
    config = make_config("memory", metrics={"directory": str(metrics)})
    writer = TieredWriter(config)
    dcp.save({"w": torch.randn(4096), "step": 1}, storage_writer=writer, checkpoint_id="step_1")
    found = of_rank(metrics, 0)
    at = {"rank": "0", "tier": "memory"}
    first_bytes = rank_bytes(config, "step_1")
    assert first_bytes >= 4096 * 4
    assert value(found, "tierstore_save_written_bytes_total", **at) == first_bytes
    assert value(found, "tierstore_saves_written_total", **at) == 1
    assert value(found, "tierstore_saves_committed_total", **at) == 1
    manifest = read_manifest(config.make_tier("memory", node=0), "step_1", trust=MarkerTrust())
    assert value(found, "tierstore_save_last_commit_seconds", **at) == pytest.approx(
        manifest.timings["commit_s"]
    )
    plain_stall = value(found, "tierstore_save_last_stall_seconds", **at)
    assert plain_stall is not None and plain_stall > 0  # dcp.save blocks for the whole write

    future = dcp.async_save(
        {"w": torch.randn(8192), "step": 2}, storage_writer=writer, checkpoint_id="step_2"
    )
    future.result()
    writer.close()
    found = of_rank(metrics, 0)
    assert value(found, "tierstore_saves_committed_total", **at) == 2
    assert value(found, "tierstore_save_stall_seconds_count", **at) == 2
    assert value(found, "tierstore_save_written_bytes_total", **at) == first_bytes + rank_bytes(
        config, "step_2"
    )
    assert value(found, "tierstore_save_last_wait_seconds", **at) is not None  # staged: measured
    staged_stall = value(found, "tierstore_save_last_stall_seconds", **at)
    assert staged_stall is not None and staged_stall > 0
    assert staged_stall == pytest.approx(
        read_manifest(config.make_tier("memory", node=0), "step_2", trust=MarkerTrust()).timings["stall_s"]
    )
    assert value(found, "tierstore_saves_failed_total", **at) == 0  # there from the first save, at 0


def test_a_vetoed_save_counts_as_failed(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    metrics = tmp_path / "metrics"
    config = make_config("memory", metrics={"directory": str(metrics)})
    writer = TieredWriter(config, commit_gate=lambda _view: "loss is NaN")
    with pytest.raises(BaseException, match="loss is NaN"):
        dcp.save({"w": torch.randn(64)}, storage_writer=writer, checkpoint_id="step_1")
    found = of_rank(metrics, 0)
    at = {"rank": "0", "tier": "memory"}
    assert value(found, "tierstore_saves_failed_total", **at) == 1
    assert value(found, "tierstore_saves_written_total", **at) == 0
    assert value(found, "tierstore_saves_committed_total", **at) == 0


def test_without_a_metrics_directory_nothing_is_written(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    config = make_config("memory")
    assert config.metrics.directory is None
    before = set(tmp_path.rglob("*.prom"))
    dcp.save({"w": torch.randn(64)}, storage_writer=TieredWriter(config), checkpoint_id="step_1")
    assert set(tmp_path.rglob("*.prom")) == before


def two_ranks_save(rank: int, world: int, config: Config) -> None:
    writer = TieredWriter(config)
    for step in (1, 2):
        # a key of its own: DCP writes a tensor every rank holds (replicated) from one rank only
        state = {f"w{rank}": torch.full((1000 * (rank + 1),), float(rank)), "step": step}
        dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step_{step}").result()
    writer.close()
    dist.barrier()


def test_two_ranks_of_a_job_each_keep_their_file_served_by_one_promoter(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    from tierstore.promote.sidecar import Promoter

    metrics = tmp_path / "metrics"
    config = make_config("memory", metrics={"directory": str(metrics)})
    run_ranks(two_ranks_save, 2, tmp_path, config)
    found = scrape(Promoter(config, node=0).serve(0, "127.0.0.1"))
    for rank, numel in ((0, 1000), (1, 2000)):
        at = {"rank": str(rank), "tier": "memory"}
        assert value(found, "tierstore_saves_written_total", **at) == 2
        assert value(found, "tierstore_save_stall_seconds_count", **at) == 2
        written = value(found, "tierstore_save_written_bytes_total", **at)
        assert written is not None and written >= 2 * numel * 4
    assert value(found, "tierstore_saves_committed_total", rank="0", tier="memory") == 2
    assert value(found, "tierstore_saves_committed_total", rank="1", tier="memory") == 0


def process_mode_saves(rank: int, world: int, config: Config) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = TieredWriter(config)
    for step in (1, 2):
        dcp.async_save(
            {"w": torch.randn(2048), "step": step},
            storage_writer=writer,
            checkpoint_id=f"step_{step}",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
    writer.close()


def test_saves_run_in_dcps_checkpoint_process_count_like_the_trainers(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    metrics = tmp_path / "metrics"
    config = make_config("memory", metrics={"directory": str(metrics)})
    run_ranks(process_mode_saves, 1, tmp_path, config)
    found = of_rank(metrics, 0)
    at = {"rank": "0", "tier": "memory"}
    assert value(found, "tierstore_saves_committed_total", **at) == 2
    assert value(found, "tierstore_save_stall_seconds_count", **at) == 2  # staged in the trainer
    assert value(found, "tierstore_save_last_wait_seconds", **at) is not None
    assert value(found, "tierstore_save_written_bytes_total", **at) == rank_bytes(
        config, "step_1"
    ) + rank_bytes(config, "step_2")


# -- configuration ---------------------------------------------------------------------------------


def tiers(tmp_path: Path) -> list[dict[str, Any]]:
    return [{"name": "ram", "type": "memory", "path": str(tmp_path / "ram" / "{node}")}]


def test_the_directory_is_relative_to_the_yaml_and_per_node(tmp_path: Path) -> None:
    source = str(tmp_path / "conf" / "tierstore.yaml")
    data = {"tiers": tiers(tmp_path), "metrics": {"directory": "m/{node}", "stale_after": "2h"}}
    config = config_from_dict(data, source=source, node=3)
    assert config.metrics.directory == str(tmp_path / "conf" / "m" / "{node}")
    assert config.metrics.directory_for(3) == str(tmp_path / "conf" / "m" / "3")
    assert (tmp_path / "conf" / "m" / "3").is_dir()  # created, like a tier's directory
    assert config.metrics.stale_after == 7200.0


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({"directory": "m/{rank}"}, "metrics.directory: expected a path whose only placeholder"),
        ({"directory": " "}, "metrics.directory: expected a directory, got an empty string"),
        ({"directory": "ram/0/metrics"}, "metrics.directory: expected a directory outside every"),
        ({"directory": "m", "stale_after": "soon"}, "metrics.stale_after: expected a duration"),
        ({"port": 9400}, "metrics.port: unknown key 'port'"),
    ],
)
def test_bad_metrics_keys_are_named(tmp_path: Path, metrics: dict[str, Any], expected: str) -> None:
    source = str(tmp_path / "tierstore.yaml")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        config_from_dict({"tiers": tiers(tmp_path), "metrics": metrics}, source=source, node=0)


def test_an_unwritable_directory_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    data = {"tiers": tiers(tmp_path), "metrics": {"directory": str(tmp_path / "a-file" / "m")}}
    with pytest.raises(ConfigError, match=r"metrics\.directory: expected a writable directory"):
        config_from_dict(data, source=str(tmp_path / "t.yaml"), node=0)


def test_the_metrics_keys_are_documented() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for key in Config.model_fields["metrics"].annotation.model_fields:  # type: ignore[union-attr]
        assert f"`metrics.{key}`" in docs


# -- counters that exist before their first increment ----------------------------------------------


def test_a_rank_counts_from_zero_before_its_first_save_fails(tmp_path: Path) -> None:
    """The first failure of a rank must raise ``increase()``: its counters exist at 0 from the save's
    set-up, before any outcome is recorded."""
    recorder = SaveRecorder(str(tmp_path))
    recorder.started(3, "ram")
    before = of_rank(tmp_path, 3)
    for name in (
        "tierstore_saves_failed_total",
        "tierstore_saves_committed_total",
        "tierstore_saves_written_total",
    ):
        assert value(before, name, rank="3", tier="ram") == 0.0, name
    recorder.failed(3, "ram")
    assert value(of_rank(tmp_path, 3), "tierstore_saves_failed_total", rank="3", tier="ram") == 1.0
    recorder.started(3, "ram")  # a later save does not reset what was counted
    assert value(of_rank(tmp_path, 3), "tierstore_saves_failed_total", rank="3", tier="ram") == 1.0


def test_a_promoter_counts_from_zero_from_its_start(make_config: Callable[..., Config]) -> None:
    from tierstore.promote.sidecar import Promoter

    promoter = Promoter(make_config("memory", "local"))
    exposition = series(generate_latest(promoter.metrics.registry).decode())
    for name in (
        "tierstore_promotion_failures_total",
        "tierstore_retries_total",
        "tierstore_promoted_bytes_total",
    ):
        for tier in ("memory", "local"):
            assert value(exposition, name, tier=tier) == 0.0, (name, tier)
