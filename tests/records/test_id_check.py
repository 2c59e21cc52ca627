"""``is_checkpoint_id`` (the listings' filter, called for every log entry and marker listed) must
say exactly what ``validate_checkpoint_id`` does: its fast path for strings is checked against the
full validation on arbitrary names, the reserved ones and the length limit."""

from __future__ import annotations

from pathlib import PurePosixPath

from hypothesis import given
from hypothesis import strategies as st

from tierstore.errors import InvalidCheckpointIdError
from tierstore.ids import MAX_ID_LENGTH, is_checkpoint_id, validate_checkpoint_id

NAME_CHARS = st.sampled_from("abcXYZ019._-/~ é\x00")


def _valid(value: object) -> bool:
    try:
        validate_checkpoint_id(value)
    except InvalidCheckpointIdError:
        return False
    return True


@given(st.text(NAME_CHARS, max_size=12) | st.text(max_size=8))
def test_agrees_with_the_full_validation(value: str) -> None:
    assert is_checkpoint_id(value) == _valid(value)


def test_reserved_names_lengths_and_path_likes() -> None:
    for value in ("", ".", "..", ".tierstore", "a" * (MAX_ID_LENGTH + 1)):
        assert not is_checkpoint_id(value) and not _valid(value)
    assert is_checkpoint_id("a" * MAX_ID_LENGTH)
    assert is_checkpoint_id(PurePosixPath("step_1"))  # type: ignore[arg-type]
    assert not is_checkpoint_id(PurePosixPath("a/b"))  # type: ignore[arg-type]
    assert not is_checkpoint_id(7)  # type: ignore[arg-type]
