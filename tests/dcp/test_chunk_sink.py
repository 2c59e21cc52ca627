"""ChunkSink: with a writer, the checksum runs on a helper thread; its failure must still fail the
file, as it does without a writer, never leave a CRC32C that misses the bytes written."""

from __future__ import annotations

import pytest

from tierstore.checksum import crc32c
from tierstore.dcp.layout import ChunkSink


def _unreadable_by_crc32c() -> memoryview:
    """A chunk the writer can take (``bytes()`` copies it) but crc32c refuses (not contiguous)."""
    return memoryview(bytearray(b"abcdefgh"))[::2]


def test_without_a_writer_a_chunk_the_checksum_refuses_raises_at_once() -> None:
    with pytest.raises(BufferError):
        ChunkSink(None).feed(_unreadable_by_crc32c())


def test_with_a_writer_the_helpers_checksum_failure_fails_the_sink_not_a_wrong_crc() -> None:
    written: list[bytes] = []
    sink = ChunkSink(lambda view: written.append(bytes(view)))
    sink.feed(memoryview(b"head"))
    sink.mark()
    sink.feed(_unreadable_by_crc32c())
    sink.mark()
    sink.feed(memoryview(b"tail"))
    assert b"".join(written) == b"headacegtail"
    # Before: the helper logged the failure, and crc/marks described "headtail", not the file.
    with pytest.raises(BufferError):
        _ = sink.crc
    with pytest.raises(BufferError):  # asked again, the same answer (nothing reads a wrong CRC)
        _ = sink.marks
    with pytest.raises(BufferError):
        _ = sink.sha256


def test_leaving_the_block_raises_the_helpers_failure() -> None:
    with pytest.raises(BufferError), ChunkSink(lambda view: None) as sink:
        sink.feed(_unreadable_by_crc32c())


def test_an_error_of_the_block_itself_wins_over_the_helpers() -> None:
    with pytest.raises(OSError, match="disk full"), ChunkSink(lambda view: None) as sink:
        sink.feed(_unreadable_by_crc32c())
        raise OSError("disk full")


def test_a_good_file_gets_the_crc_and_marks_of_its_bytes() -> None:
    written: list[bytes] = []
    with ChunkSink(lambda view: written.append(bytes(view))) as sink:
        sink.feed(memoryview(b"head"))
        sink.mark()
        sink.feed_span(memoryview(b"x" * 10_000), 0, 10_000)
    assert sink.crc == crc32c(b"".join(written))
    assert sink.marks == [crc32c(b"head")]
