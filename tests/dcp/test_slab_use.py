"""A slab's readers-writer lock: saves writing it out keep stages away, and the reverse."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tierstore.dcp.staging import slab_use
from tierstore.dcp.staging.slab_use import SlabUse


def test_a_stage_waits_for_every_save_reading_the_slab_and_says_so_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(slab_use, "_WARN_EVERY_S", 0.2)
    use = SlabUse()
    staged = threading.Event()

    def stage() -> None:
        with use.staging():
            staged.set()

    with caplog.at_level(logging.WARNING), use.reading(), use.reading():
        stager = threading.Thread(target=stage)
        stager.start()
        time.sleep(0.5)
        assert not staged.is_set(), "the stage copied while saves were writing the slab out"
    stager.join(5)
    assert staged.is_set()
    assert "still writing this staging buffer out" in caplog.text


def test_a_save_waits_for_a_stage_copying_into_the_slab() -> None:
    use = SlabUse()
    copying, read = threading.Event(), threading.Event()
    release = threading.Event()

    def stage() -> None:
        with use.staging():
            copying.set()
            release.wait(5)

    stager = threading.Thread(target=stage)
    stager.start()
    assert copying.wait(5)

    def save() -> None:
        with use.reading():
            read.set()

    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(0.3)
    assert not read.is_set(), "a save read the slab while a stage was copying into it"
    release.set()
    saver.join(5)
    stager.join(5)
    assert read.is_set()
