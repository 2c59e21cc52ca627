"""Save metrics against hostile files: a FIFO, a file for the directory, bytes that are not UTF-8, a
huge file, a file that claims another rank's series. A save never waits on them, and the promoter
keeps serving its own metrics and every honest rank's (issue 26 review)."""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hung_files import fifo_at
from tierstore._platform.save_metrics import MAX_FILE_BYTES, SaveRecorder, rank_file, read_directory
from tierstore.promote.health import PromoterHealth
from tierstore.promote.metrics import PromoterMetrics


def record(directory: Path, rank: int = 0) -> None:
    SaveRecorder(str(directory)).written(rank, "ram", nbytes=4096, write_s=0.1, save_s=0.1)


def written(directory: Path, rank: int) -> float | None:
    for family in read_directory(str(directory)):
        for sample in family.samples:
            if sample.name == "tierstore_saves_written_total" and sample.labels["rank"] == str(rank):
                return sample.value
    return None


def within(seconds: float, work: Callable[[], object]) -> bool:
    """Run ``work`` on a daemon thread; True when it ended within ``seconds`` (a hang fails)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def scrape_own_and_ranks(directory: Path) -> dict[str, float]:
    metrics = PromoterMetrics()
    metrics.watch(PromoterHealth(300.0), str(directory), stale_after=0.0)
    port = metrics.serve(0, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.timeout(60, method="thread")
def test_a_fifo_for_a_ranks_file_neither_stalls_the_save_nor_the_scrape(tmp_path: Path) -> None:
    record(tmp_path, rank=1)
    with fifo_at(tmp_path / rank_file(0)):
        assert within(5, lambda: record(tmp_path, rank=0)), "the save waited on its metrics file"
        assert within(5, lambda: read_directory(str(tmp_path))), "the scrape waited on a FIFO"
        assert written(tmp_path, 1) == 1


def test_a_file_where_the_directory_should_be_leaves_the_promoters_own_metrics(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    directory.write_text("a file, not a directory")
    assert read_directory(str(directory)) == []
    served = scrape_own_and_ranks(directory)
    assert any(name.startswith("tierstore_promoter_live") for name in served)


def test_a_file_that_is_not_utf8_starts_over_and_counts_on(tmp_path: Path) -> None:
    (tmp_path / rank_file(0)).write_bytes(b"\xff\xfe not text \x80")
    record(tmp_path)
    record(tmp_path)
    assert written(tmp_path, 0) == 2


def test_a_huge_file_is_neither_read_whole_by_the_save_nor_served(tmp_path: Path) -> None:
    record(tmp_path, rank=1)
    (tmp_path / rank_file(0)).write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    (tmp_path / "big.prom").write_bytes(b"x 1\n" * (MAX_FILE_BYTES // 4 + 1))
    assert written(tmp_path, 0) is None and written(tmp_path, 1) == 1
    record(tmp_path)  # starts over: the huge file is replaced by the rank's own
    assert written(tmp_path, 0) == 1


def test_only_a_ranks_own_file_speaks_for_that_rank(tmp_path: Path) -> None:
    record(tmp_path, rank=1)
    (tmp_path / "a-textfile.prom").write_text(
        "# TYPE tierstore_saves_written counter\n"
        'tierstore_saves_written_total{rank="1",tier="ram"} 0\n'
        'tierstore_drill_success{tier="s3"} 1\n'
    )
    (tmp_path / rank_file(2)).write_text(
        '# TYPE tierstore_saves_written counter\ntierstore_saves_written_total{rank="1",tier="ram"} 99\n'
    )
    assert written(tmp_path, 1) == 1
    served = scrape_own_and_ranks(tmp_path)
    assert served["tierstore_drill_success[('tier', 's3')]"] == 1, "other textfiles still served"


def test_a_full_directory_leaves_no_temporary_file(mount_tmpfs: Callable[[str], Path]) -> None:
    directory = mount_tmpfs("64k")
    with contextlib.suppress(OSError):
        (directory / "filler").write_bytes(b"\0" * 128 * 1024)  # fills the tmpfs: ENOSPC
    record(directory)  # never raises: the failure is logged
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []
