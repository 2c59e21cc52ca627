"""A crafted ``.metadata`` cannot make a load read outside the committed copy (issue 22, row 12).

Someone who can write a tier can rewrite ``.metadata`` and its marker entry consistently (size and
CRC32C match). Its item locations are still checked against the files the marker names before a byte
of data is read: a path leaving the checkpoint (``../``, another id's file) or a range past the end of
a named file is refused, naming the item and the path.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter
from tierstore.checksum import crc32c
from tierstore.config import Config
from tierstore.ids import checkpoint_file, is_metadata_file, marker_path
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust


def _craft(config: Config, change: Callable[[object], object]) -> None:
    """Rewrite x's ``.metadata`` with ``change`` applied to one item location; fix its marker entry."""
    (tier,) = config.make_tiers(node=0)
    manifest = read_manifest(tier, "x", trust=MarkerTrust())
    entry = next(f for f in manifest.files if is_metadata_file(f.path))
    metadata = pickle.loads(tier.read_bytes(checkpoint_file("x", entry.path)))
    index, location = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = change(location)
    blob = pickle.dumps(metadata)
    tier.write_bytes(checkpoint_file("x", entry.path), blob)
    fixed = dataclasses.replace(entry, size=len(blob), crc32c=crc32c(blob))
    files = tuple(fixed if f is entry else f for f in manifest.files)
    tier.publish(marker_path("x"), manifest.with_changes(files=files).to_json(), create_only=False)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda loc, other: dataclasses.replace(loc, path=f"../y/{other}"), "does not name"),
        (lambda loc, _other: dataclasses.replace(loc, path="/etc/hostname"), "does not name"),
        (lambda loc, _other: dataclasses.replace(loc, offset=loc.offset + 10**6), "spans bytes"),
    ],
    ids=["another-id", "absolute", "past-the-end"],
)
def test_a_crafted_item_location_is_refused_before_any_data_is_read(
    make_config: Callable[..., Config], change: Callable[..., object], refusal: str
) -> None:
    config = make_config("local")
    dcp.save({"w": torch.zeros(64)}, storage_writer=TieredWriter(config), checkpoint_id="x")
    dcp.save({"w": torch.full((64,), 7.0)}, storage_writer=TieredWriter(config), checkpoint_id="y")
    (tier,) = config.make_tiers(node=0)
    other = next(
        f.path for f in read_manifest(tier, "y", trust=MarkerTrust()).files if f.path.endswith(".distcp")
    )
    _craft(config, lambda location: change(location, other))
    target = {"w": torch.ones(64)}
    with pytest.raises(BaseException, match=refusal):
        dcp.load(target, storage_reader=TieredReader(config), checkpoint_id="x")
    assert torch.equal(target["w"], torch.ones(64)), "nothing was read into the tensors"
