"""YAML configuration: a valid file loads into an immutable Config; each mistake names file and key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from tierstore.config import load_config
from tierstore.errors import ConfigError
from tierstore.units import parse_duration, parse_size

VALID = """
namespace: my-run
tiers:
  - {name: ram, type: memory, path: "%(tmp)s/shm/{node}", keep: 2}
  - {name: nvme, type: local, path: "%(tmp)s/nvme/{node}", keep: 3}
  - {name: pfs, type: shared, path: "%(tmp)s/pfs"}
  - {name: s3, type: s3, url: s3://bucket/prefix, endpoint_url: http://127.0.0.1:9000, keep: 10}
promote:
  every: 5
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tierstore.yaml"
    path.write_text(text % {"tmp": tmp_path} if "%(tmp)s" in text else text)
    return path


def test_valid_file_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, VALID))
    assert [t.name for t in config.tiers] == ["ram", "nvme", "pfs", "s3"]
    assert config.promote.every == 5
    assert config.namespace == "my-run"
    assert config.tier("nvme").keep == 3
    assert (tmp_path / "shm" / "0" / "my-run").is_dir(), "POSIX tier roots are created"
    with pytest.raises(ValidationError):
        config.tiers[0].keep = 5  # type: ignore[misc]


def test_env_expansion_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_BUCKET", "my-bucket")
    config = load_config(
        write(
            tmp_path,
            "tiers:\n  - {name: disk, type: local, path: rel/dir}\n"
            "  - {name: s3, type: s3, url: 's3://${CKPT_BUCKET}/${PREFIX:-runs}'}\n",
        )
    )
    assert config.tiers[0].path == str(tmp_path / "rel" / "dir")
    assert config.tier("s3").url == "s3://my-bucket/runs"


def test_sizes_and_durations() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("1GB") == 10**9
    assert parse_size(1024) == 1024
    assert parse_duration("250ms") == 0.25
    assert parse_duration("5m") == 300
    with pytest.raises(ValueError):
        parse_size("lots")


BAD = [
    ("tiers: [\n  {name: a, type: memory", "line", "malformed YAML"),
    ("- just\n- a list\n", "top level", "expected a mapping"),
    ("tiers:\n  - {name: a, type: tape, path: /tmp}\n", "tiers[0]", "unknown tier type 'tape'"),
    ("tiers:\n  - {name: a, type: local}\n", "tiers[0].path", "missing required key 'path'"),
    ("tiers:\n  - {name: a, type: s3}\n", "tiers[0].url", "missing required key 'url'"),
    (
        "tiers:\n  - {name: a, type: memory, paht: /dev/shm/x}\n",
        "tiers[0].paht",
        "unknown key 'paht'",
    ),
    ("tiers:\n  - {name: a, type: memory, keep: many}\n", "tiers[0].keep", "integer"),
    (
        "tiers:\n  - {name: a, type: memory, keep: 0}\n",
        "tiers[0].keep",
        "expected a value >= 1, got 0",
    ),
    (
        "tiers:\n  - {name: a, type: memory}\n  - {name: a, type: local, path: /tmp/x}\n",
        "tiers",
        "duplicate tier name 'a'",
    ),
    ("tiers:\n  - {name: a, type: memory}\npromote: {every: -3}\n", "promote.every", ">= 1"),
    (
        "tiers:\n  - {name: a, type: memory}\npromote: {interval: soon}\n",
        "promote.interval",
        "duration",
    ),
    ("tiers: []\n", "tiers", "at least 1 item"),
    ("tier:\n  - {name: a, type: memory}\n", "tier", "unknown key 'tier'"),
    ("tiers:\n  - {name: a, type: s3, url: 'http://bucket'}\n", "tiers[0].url", "s3://bucket"),
    (
        "tiers:\n  - {name: a, type: s3, url: 's3://b-1', part_size: 1MiB}\n",
        "tiers[0].part_size",
        "",
    ),
    ("tiers:\n  - {name: 'a b', type: memory}\n", "tiers[0].name", "letters, digits"),
    (
        "tiers:\n  - {name: a, type: memory}\ntiers:\n  - {name: b, type: memory}\n",
        "line",
        "duplicate key",
    ),
    ("tiers:\n  - {name: a, type: shared, path: '/tmp/{node}'}\n", "tiers", "only for node-local"),
    (
        "tiers:\n  - {name: a, type: memory, path: '${NOT_SET_ANYWHERE}'}\n",
        "tiers[0].path",
        "NOT_SET",
    ),
    ("tiers:\n  - {name: a, type: memory}\nnamespace: '../escape'\n", "namespace", "names of"),
    ("tiers:\n  - {type: memory}\n", "tiers[0].name", "missing required key 'name'"),
    ("tiers:\n  - {name: a}\n", "tiers[0]", "missing required key 'type'"),
    ("tiers:\n  - {name: a, type: memory, pin: ['../x']}\n", "tiers[0].pin", "checkpoint id"),
    (
        "verify_on_load: perhaps\ntiers:\n  - {name: a, type: memory}\n",
        "verify_on_load",
        "expected true or false",
    ),
]


@pytest.mark.parametrize(("text", "key", "expected"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_malformed_files_name_file_and_key(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(str(path.resolve())), message
    assert f": {key}" in message, message
    assert expected in message, message


def test_unwritable_path_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = write(tmp_path, f"tiers:\n  - {{name: disk, type: local, path: '{blocker}/sub'}}\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: expected a writable directory"):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        load_config(tmp_path / "absent.yaml")


def test_unknown_tier_lookup_lists_known_names(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, VALID))
    with pytest.raises(ConfigError, match=r"no tier named 'tape' \(known: ram, nvme, pfs, s3\)"):
        config.tier("tape")


def test_config_pickles(tmp_path: Path) -> None:
    import pickle

    config = load_config(write(tmp_path, VALID))
    assert pickle.loads(pickle.dumps(config)) == config
    assert os.fspath(config.origin).endswith("tierstore.yaml")


@pytest.mark.parametrize(
    ("staging", "expected"),
    [("{overlap: perhaps}", "staging.overlap: expected true or false"),
     ("{overlap: true, copy: later}", "staging.copy: unknown key 'copy'")],
)  # fmt: skip
def test_staging_overlap_is_off_by_default_and_validated(
    tmp_path: Path, staging: str, expected: str
) -> None:
    tiers = "tiers:\n  - {name: a, type: memory, path: '%(tmp)s/shm'}\n"
    assert load_config(write(tmp_path, tiers)).staging.overlap is False
    assert load_config(write(tmp_path, tiers + "staging: {overlap: true}\n")).staging.overlap
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, tiers + f"staging: {staging}\n"))
