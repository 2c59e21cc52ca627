"""A promoter's marker cache is written by reads the Prober gave up on (a slow tier's, still
running on their daemon threads) while the next listing forgets another tier's deleted ids: the
forgetting must not trip over those writes (``dictionary changed size during iteration`` ended
the listing of a tier that was answering fine)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tests.simulated_job import manifest_for
from tierstore.config import Config
from tierstore.ids import marker_path
from tierstore.promote.discovery import MarkerCache
from tierstore.records.catalog import marker_times
from tierstore.signing import MarkerTrust


def test_forgetting_a_tiers_ids_while_late_reads_of_another_tier_land(
    make_config: Callable[..., Config],
) -> None:
    (slow,) = make_config("shared").make_tiers(node=0)
    for index in range(1, 41):
        manifest = manifest_for(index, 1, "")
        slow.write_bytes(marker_path(manifest.checkpoint_id), manifest.to_json())
    mtimes = marker_times(slow)
    cache = MarkerCache(MarkerTrust())
    kept = {f"step_{i:08d}" for i in range(20_000)}  # a tier that keeps many: a long iteration
    first = next(iter(mtimes))
    cache.read(slow, first, mtimes[first])
    cache.entries.update({("memory", i): cache.entries[(slow.name, first)] for i in kept})
    done = threading.Event()

    def late_reads() -> None:  # what reads abandoned by the Prober do: insert entries, again
        while not done.is_set():
            for checkpoint_id, mtime in mtimes.items():
                cache.read(slow, checkpoint_id, mtime)
            cache.keep_only(slow.name, set())  # and the next pass forgets them again

    reader = threading.Thread(target=late_reads, daemon=True)
    reader.start()
    try:
        for _round in range(300):
            cache.keep_only("memory", kept)  # another tier's listing, on its own thread
    finally:
        done.set()
        reader.join()
