"""Two tiers on one directory (issue 22, row 7): refused when the configuration is loaded.

The same path, one tier's directory inside the other's, or a symlink to it: plain saves failed with a
misleading "committed by another writer", and with ``overwrite=True`` memory retention deleted the
shared tier's copy. A ``ConfigError`` now names both tiers and the directory they share.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierstore.config import config_from_dict
from tierstore.errors import ConfigError


def _tiers(first: Path, second: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"name": "ram", "type": "memory", "path": str(first)},
            {"name": "disk", "type": "shared", "path": str(second)},
        ]
    }


@pytest.mark.parametrize("layout", ["same", "nested", "symlink", "nested-the-other-way"])
def test_tiers_sharing_a_directory_are_refused_naming_both(tmp_path: Path, layout: str) -> None:
    base = tmp_path / "ckpt"
    base.mkdir()
    other = {
        "same": base,
        "nested": base / "inner",
        "symlink": tmp_path / "link",
        "nested-the-other-way": tmp_path,
    }[layout]
    if layout == "symlink":
        os.symlink(base, other)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path: .*disk.* and .*ram.*"):
        config_from_dict(_tiers(base, other))


def test_separate_directories_and_namespaces_are_fine(tmp_path: Path) -> None:
    config_from_dict(_tiers(tmp_path / "a", tmp_path / "b"))
    config_from_dict({**_tiers(tmp_path / "a", tmp_path / "ab"), "namespace": "run"})
