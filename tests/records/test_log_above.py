"""The commit log listed from a known number on (``highest_in(tier, above=n)``, records/log.py)
answers what the whole log does, also past the 12 digits a number is padded to: names sort as
numbers only while they have the same length."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tierstore.config import Config
from tierstore.ids import commit_entry_path, void_entry_path
from tierstore.records.log import highest_in


@pytest.mark.parametrize("kind", ["shared", "s3"])
def test_numbers_longer_than_their_padding_are_seen_above_a_known_number(
    make_config: Callable[..., Config], kind: str
) -> None:
    (tier,) = make_config(kind).make_tiers(node=0)
    tier.write_bytes(commit_entry_path(2 * 10**11, "a", "g" + "0" * 19), b"")
    tier.write_bytes(commit_entry_path(10**12, "b", "g" + "1" * 19), b"")  # 13 digits
    tier.write_bytes(void_entry_path(10**13 + 5), b"")  # 14 digits
    assert highest_in(tier) == 10**13 + 5
    for above in (5, 10**11, 2 * 10**11, 10**12, 10**12 + 1):
        assert highest_in(tier, above=above) == 10**13 + 5, above
    assert highest_in(tier, above=10**13 + 5) == 10**13 + 5
    assert highest_in(tier, above=10**14) == 10**14
