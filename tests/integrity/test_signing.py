"""Signed markers (issue 24, item 7): with the job's key in the environment every marker carries an
HMAC over its signed body (every file's size, CRC32C and SHA-256, ``.metadata`` included), and a
reader with the key refuses anything unsigned or mis-signed before it unpickles a byte.

CRC32C is no defence against a tier writer: :func:`_forge` makes a different file with the same size
and CRC32C, as anyone can. The malicious ``.metadata`` tests run with the safe-pickle allowlist
bypassed (plain ``pickle.loads``), so they prove the signature check, not the allowlist, stops the
payload; each has a control in which the same payload does run without the key.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import Catalog, ConfigError, TieredReader, TieredWriter
from tierstore.checksum import crc32c
from tierstore.config import Config
from tierstore.ids import checkpoint_file, marker_path
from tierstore.promote.sidecar import Promoter
from tierstore.records.marker import Manifest, read_manifest, signed_body
from tierstore.signing import keys_from_env

KEY = "k3y-0f-the-j0b-" + "5" * 24
OLD_KEY = "an-older-key-of-the-job-0123456789"


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)
    yield KEY


def _state() -> dict[str, object]:
    return {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5), "step": 7}


def _save(config: Config, checkpoint_id: str = "x") -> None:
    dcp.save(_state(), storage_writer=TieredWriter(config), checkpoint_id=checkpoint_id)


def _load(config: Config, checkpoint_id: str = "x") -> dict[str, object]:
    state: dict[str, object] = {"w": torch.zeros(64), "b": torch.zeros(3, 5), "step": 0}
    dcp.load(state, storage_reader=TieredReader(config, collective=False), checkpoint_id=checkpoint_id)
    return state


def _assert_exact(state: dict[str, object]) -> None:
    want = _state()
    assert torch.equal(state["w"], want["w"])  # type: ignore[arg-type]
    assert torch.equal(state["b"], want["b"])  # type: ignore[arg-type]
    assert state["step"] == 7


def _forge(original: bytes, wanted: bytes) -> bytes:
    """``wanted`` padded to ``len(original)`` bytes whose CRC32C equals ``original``'s: its last
    4 bytes solve the (affine, over GF(2)) CRC equation. Anyone can do this; no key needed."""
    assert len(wanted) + 4 <= len(original)
    prefix = wanted + b"\0" * (len(original) - len(wanted) - 4)
    base = crc32c(prefix + b"\0\0\0\0")
    columns = [crc32c(prefix + (1 << bit).to_bytes(4, "little")) ^ base for bit in range(32)]
    target = crc32c(original) ^ base
    rows = [(columns[bit], 1 << bit) for bit in range(32)]  # (crc contribution, chosen bits)
    basis: dict[int, tuple[int, int]] = {}
    for row in rows:
        value, chosen = row
        for top in sorted(basis, reverse=True):
            if value >> top & 1:
                value, chosen = value ^ basis[top][0], chosen ^ basis[top][1]
        if value:
            basis[value.bit_length() - 1] = (value, chosen)
    x = 0
    for top in sorted(basis, reverse=True):
        if target >> top & 1:
            target, x = target ^ basis[top][0], x ^ basis[top][1]
    assert target == 0
    forged = prefix + x.to_bytes(4, "little")
    assert len(forged) == len(original) and crc32c(forged) == crc32c(original)
    return forged


class _Payload:
    """Unpickling this creates ``sentinel``: a stand-in for any code an attacker wants run."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.sentinel,))


@pytest.fixture
def no_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader unpickles ``.metadata`` with plain pickle: the allowlist is not what saves us."""
    monkeypatch.setattr(
        "tierstore.dcp.restore.metadata.load_metadata", lambda blob, where: pickle.loads(blob)
    )


def _metadata_entry(manifest: Manifest) -> tuple[str, int]:
    index = next(i for i, f in enumerate(manifest.files) if f.path.endswith(".metadata"))
    return checkpoint_file(manifest.checkpoint_id, manifest.files[index].path), index


def test_a_signed_marker_names_every_sha256_and_loads_bit_exact(
    key: str, make_config: Callable[..., Config]
) -> None:
    config = make_config("local")
    _save(config)
    (tier,) = config.make_tiers(node=0)
    manifest = read_manifest(tier, "x", trust=config.marker_trust())
    assert manifest.signature is not None and manifest.signature.startswith("hmac-sha256:")
    assert {f.path.rsplit("/", 1)[1] for f in manifest.files} >= {".metadata"}
    for entry in manifest.files:
        data = tier.read_bytes(checkpoint_file("x", entry.path))
        assert entry.sha256 == __import__("hashlib").sha256(data).hexdigest()
    keys = keys_from_env("TIERSTORE_SIGNING_KEY")
    assert keys is not None and keys.accepts(signed_body(manifest), manifest.signature)
    _assert_exact(_load(config))


@pytest.mark.parametrize("how", ["same size and CRC32C, marker untouched", "marker rewritten"])
def test_a_malicious_metadata_never_runs_for_a_reader_with_the_key(
    how: str, key: str, make_config: Callable[..., Config], no_allowlist: None, tmp_path: Path
) -> None:
    config = make_config("local")
    _save(config)
    (tier,) = config.make_tiers(node=0)
    manifest = read_manifest(tier, "x", trust=config.marker_trust())
    path, index = _metadata_entry(manifest)
    sentinel = tmp_path / "payload-ran"
    payload = pickle.dumps(_Payload(sentinel))
    original = tier.read_bytes(path)
    if how == "marker rewritten":  # any payload; the marker's size and CRC32C made to fit
        tier.write_bytes(path, payload)
        files = list(manifest.files)
        files[index] = files[index].__class__(
            files[index].path, len(payload), crc32c(payload), None, files[index].node, None
        )
        body = json.loads(manifest.with_changes(files=tuple(files)).to_json())
        tier.publish(marker_path("x"), json.dumps(body).encode(), create_only=False)
    else:  # the marker and its signature stay valid: only the SHA-256 tells the files apart
        tier.write_bytes(path, _forge(original, payload))
    with pytest.raises(BaseException) as refused:  # DCP wraps it in its own
        _load(config)
    assert not sentinel.exists()
    text = str(refused.value)
    assert "tier local" in text or "local (local, " in text  # names the tier
    assert (".metadata: SHA-256" in text) if "untouched" in how else ("x/commit.json" in text)
    assert KEY not in text
    # Control: the stored bytes are a live payload; DCP's own reader would have run it.
    pickle.loads(tier.read_bytes(path))
    assert sentinel.exists()


def test_a_tampered_first_tier_gives_way_to_the_next_tier(
    key: str, make_config: Callable[..., Config], no_allowlist: None, tmp_path: Path
) -> None:
    config = make_config("memory", "local")
    _save(config)
    assert Promoter(config).run(once=True) == 0
    memory, local = config.make_tiers(node=0)
    assert (
        read_manifest(local, "x", trust=config.marker_trust()).signature
        == read_manifest(memory, "x", trust=config.marker_trust()).signature
    )
    path, _ = _metadata_entry(read_manifest(memory, "x", trust=config.marker_trust()))
    sentinel = tmp_path / "payload-ran"
    memory.write_bytes(path, _forge(memory.read_bytes(path), pickle.dumps(_Payload(sentinel))))
    reader = TieredReader(config, collective=False)
    state: dict[str, object] = {"w": torch.zeros(64), "b": torch.zeros(3, 5), "step": 0}
    dcp.load(state, storage_reader=reader, checkpoint_id="x")
    assert reader.chosen_tier == "local" and not sentinel.exists()
    _assert_exact(state)


def test_a_marker_signed_with_another_key_is_refused_and_an_older_accepted_one_is_read(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", OLD_KEY)
    _save(make_config("local"))
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)
    config = make_config("local")
    (tier,) = config.make_tiers(node=0)
    with pytest.raises(Exception, match="signature does not match the key in TIERSTORE_SIGNING_KEY"):
        read_manifest(tier, "x", trust=config.marker_trust())
    assert Catalog(config).listings() == []
    monkeypatch.setenv("TIERSTORE_OLD_KEY", OLD_KEY)
    rotated = make_config("local", signing={"verify_key_envs": ["TIERSTORE_OLD_KEY"]})
    _assert_exact(_load(rotated))


def test_an_unsigned_checkpoint_is_refused_with_the_key_and_read_without_it(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("memory", "local")
    _save(config)  # no key yet
    monkeypatch.setenv("TIERSTORE_SIGNING_KEY", KEY)
    with pytest.raises(BaseException, match="unsigned commit marker"):
        _load(config)
    assert Promoter(config).run(once=True) == 0  # the promoter with the key copies nothing
    _memory, local = config.make_tiers(node=0)
    assert not local.exists(marker_path("x"))
    monkeypatch.delenv("TIERSTORE_SIGNING_KEY")
    _assert_exact(_load(config))  # a reader without the key reads as before


def test_require_without_the_key_is_a_config_error_naming_the_variable(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIERSTORE_SIGNING_KEY", raising=False)
    with pytest.raises(ConfigError, match="environment variable JOB_KEY is not set"):
        make_config("local", signing={"key_env": "JOB_KEY", "require": True})
    monkeypatch.setenv("JOB_KEY", "short")
    with pytest.raises(ConfigError, match="JOB_KEY holds a key shorter than 16 bytes") as short:
        make_config("local", signing={"key_env": "JOB_KEY"})
    assert "short" not in str(short.value).replace("shorter", "")
    with pytest.raises(ConfigError, match=r"signing\.key"):
        make_config("local", signing={"key": KEY})  # keys never come from the YAML


def test_signing_keys_never_print_nor_pickle_their_secret(key: str) -> None:
    keys = keys_from_env("TIERSTORE_SIGNING_KEY")
    assert keys is not None
    assert KEY not in repr(keys) and KEY.encode() not in pickle.dumps(keys)
    assert repr(pickle.loads(pickle.dumps(keys))) == repr(keys)  # rebuilt from the environment
