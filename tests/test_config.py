"""YAML configuration: a valid file loads into an immutable Config; each mistake names file and key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tierstore.config import Config, load_config
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
    assert config.policy("nvme").keep == 3
    assert (tmp_path / "shm" / "0" / "my-run").is_dir(), "POSIX tier roots are created"
    with pytest.raises(ValidationError):
        config.tiers[0].name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.policy("ram").keep = 5  # type: ignore[misc]


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
    ("tiers:\n  - {name: a, type: memory, paht: /dev/shm/x}\n", "tiers[0].paht", "unknown key 'paht'"),
    ("tiers:\n  - {name: a, type: memory, keep: many}\n", "tiers[0].keep", "integer"),
    ("tiers:\n  - {name: a, type: memory, keep: 0}\n", "tiers[0].keep", "expected a value >= 1, got 0"),
    (
        "tiers:\n  - {name: a, type: memory}\n  - {name: a, type: local, path: /tmp/x}\n",
        "tiers",
        "duplicate tier name 'a'",
    ),
    ("tiers:\n  - {name: a, type: memory}\npromote: {every: -3}\n", "promote.every", ">= 1"),
    ("tiers:\n  - {name: a, type: memory}\npromote: {interval: soon}\n", "promote.interval", "duration"),
    ("tiers: []\n", "tiers", "at least 1 item"),
    ("tier:\n  - {name: a, type: memory}\n", "tier", "unknown key 'tier'"),
    ("tiers:\n  - {name: a, type: s3, url: 'http://bucket'}\n", "tiers[0].url", "s3://bucket"),
    ("tiers:\n  - {name: a, type: s3, url: 's3://b-1', part_size: 1MiB}\n", "tiers[0].part_size", ""),
    ("tiers:\n  - {name: 'a b', type: memory}\n", "tiers[0].name", "letters, digits"),
    ("tiers:\n  - {name: a, type: memory}\ntiers:\n  - {name: b, type: memory}\n", "line", "duplicate key"),
    ("tiers:\n  - {name: a, type: shared, path: '/tmp/{node}'}\n", "tiers", "only for node-local"),
    ("tiers:\n  - {name: a, type: memory, path: '${NOT_SET_ANYWHERE}'}\n", "tiers[0].path", "NOT_SET"),
    ("tiers:\n  - {name: a, type: memory}\nnamespace: '../escape'\n", "namespace", "names of"),
    ("tiers:\n  - {type: memory}\n", "tiers[0].name", "missing required key 'name'"),
    ("tiers:\n  - {name: a}\n", "tiers[0]", "missing required key 'type'"),
    ("tiers:\n  - {name: a, type: memory, pin: ['../x']}\n", "tiers[0].pin", "checkpoint id"),
    ("tiers:\n  - {name: a, type: memory, pin: [1]}\n", "tiers[0].pin[0]", "expected a string"),
    ("tiers:\n  - {name: a, type: local, every: 0}\n", "tiers[0].every", ">= 1, got 0"),
    ("tiers:\n  - {name: a, type: memory, keep_every: x}\n", "tiers[0].keep_every", "integer"),
    ("tiers:\n  - {name: a, type: memory, keeep: 3}\n", "tiers[0].keeep", "unknown key 'keeep'"),
    (
        "verify_on_load: perhaps\ntiers:\n  - {name: a, type: memory}\n",
        "verify_on_load",
        "expected true or false",
    ),
]


@pytest.mark.parametrize(("text", "key", "expected"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_malformed_files_name_file_and_key(tmp_path: Path, text: str, key: str, expected: str) -> None:
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
    [
        ("{overlap: perhaps}", "staging.overlap: expected true or false"),
        ("{overlap: true, copy: later}", "staging.copy: unknown key 'copy'"),
    ],
)
def test_staging_overlap_is_off_by_default_and_validated(tmp_path: Path, staging: str, expected: str) -> None:
    tiers = "tiers:\n  - {name: a, type: memory, path: '%(tmp)s/shm'}\n"
    assert load_config(write(tmp_path, tiers)).staging.overlap is False
    assert load_config(write(tmp_path, tiers + "staging: {overlap: true}\n")).staging.overlap
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, tiers + f"staging: {staging}\n"))


def test_each_tier_entry_parts_into_storage_and_policy(tmp_path: Path) -> None:
    """A ``tiers`` entry keeps its YAML keys side by side; the tier's model holds its storage only
    and :meth:`Config.policy` its retention and promotion keys."""
    config = load_config(write(tmp_path, VALID.replace("keep: 10}", "keep: 10, every: 2}")))
    nvme, s3 = config.policy("nvme"), config.policy("s3")
    assert (nvme.keep, nvme.keep_every, nvme.pin, nvme.every) == (3, None, (), None)
    assert (s3.keep, s3.every) == (10, 2)
    assert config.policy("pfs") == type(nvme)(), "an entry without policy keys has the defaults"
    assert not hasattr(config.tier("nvme"), "keep")
    with pytest.raises(ConfigError, match=r"no tier named 'tape' \(known: ram, nvme, pfs, s3\)"):
        config.policy("tape")


def test_a_dump_writes_each_entry_whole_and_loads_back_as_it_was(tmp_path: Path) -> None:
    """The tests and tools that write a loaded configuration back to YAML keep every key."""
    text = VALID.replace("keep: 3}", "keep: 3, keep_every: 10, pin: [step_1], every: 2}")
    config = load_config(write(tmp_path, text))
    for mode in ("python", "json"):
        dumped = config.model_dump(mode=mode, exclude={"origin"}, exclude_none=True)
        nvme = dumped["tiers"][1]
        assert list(nvme)[:6] == ["type", "name", "keep", "keep_every", "pin", "every"]
        assert (nvme["keep"], nvme["keep_every"], list(nvme["pin"]), nvme["every"]) == (3, 10, ["step_1"], 2)
        again = tmp_path / f"again-{mode}.yaml"
        again.write_text(yaml.safe_dump(dumped))
        assert load_config(again).model_copy(update={"origin": config.origin}) == config
    assert config.model_dump(exclude_unset=True)["tiers"][2] == {
        "type": "shared",
        "name": "pfs",
        "path": str(tmp_path / "pfs"),
    }


def test_several_mistakes_in_one_entry_are_listed_in_the_entrys_key_order(tmp_path: Path) -> None:
    """Storage and policy keys are validated apart; the lines still follow the documented order
    (``type``, ``name``, the policy keys, the type's own keys, unknown keys last)."""
    path = write(tmp_path, "tiers:\n  - {path: 3, every: x, name: 'a b', paht: y, type: memory, keep: 0}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    source = str(path.resolve())
    assert str(caught.value).splitlines() == [
        f"{source}: tiers[0].name: expected letters, digits, '_' or '-', got 'a b'",
        f"{source}: tiers[0].keep: expected a value >= 1, got 0",
        f"{source}: tiers[0].every: expected an integer, got 'x'",
        f"{source}: tiers[0].path: expected a string, got 3",
        f"{source}: tiers[0].paht: unknown key 'paht'",
    ]


def test_a_config_built_in_code_parts_its_entries_too() -> None:
    config = Config.model_validate({"tiers": [{"name": "a", "type": "memory", "keep": 2}]})
    assert config.policy("a").keep == 2
    with pytest.raises(ValidationError) as caught:
        Config.model_validate({"tiers": [{"name": "a", "type": "memory", "keep": 0}]})
    assert [e["loc"] for e in caught.value.errors()] == [("tiers", 0, "keep")]
