"""The oracle after a crash (issue 24): what every kill-point and random-kill case checks.

* restore yields the checkpoint expected bit-exact (every tensor's bytes and every byte item);
* ``verify --all`` is clean: no marker stands over missing, short or wrong data;
* the S3 bucket holds no multipart upload (after recovery);
* no byte is leaked (after recovery and gc): every file in a tier root or the bucket belongs to a
  committed copy (its marker, or the generation its marker names) or is the tier's bookkeeping
  under ``.tierstore/`` (commit log, activity, sightings; never a temp file nor staging buffers).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tests.local_files import real_path
from tierstore import TieredReader
from tierstore.cli.audit import audit_all
from tierstore.config import Config, config_from_dict
from tierstore.errors import IntegrityError
from tierstore.ids import INTERNAL_DIR, MARKER_NAME, staging_dir
from tierstore.records.marker import read_manifest
from tierstore.signing import MarkerTrust
from tierstore.tiers import Tier
from tierstore.tiers.durable import is_temporary


def only_tier(config: Config, name: str) -> Config:
    """``config`` with the tier ``name`` alone: a restore that can only read that tier."""
    data = config.model_dump(mode="json", exclude={"origin"})
    data["tiers"] = [t for t in data["tiers"] if t["name"] == name]
    return config_from_dict(data)


def assert_restores(config: Config, checkpoint_id: str, expected: dict[str, Any]) -> None:
    """``checkpoint_id`` loads (in this one process) bit-exact to ``expected``."""
    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else b"" for k, v in expected.items()}
    reader = TieredReader(config, collective=False)
    dcp.load(state, storage_reader=reader, checkpoint_id=checkpoint_id)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            loaded = state[key]
            assert isinstance(loaded, torch.Tensor)
            same = loaded.view(torch.uint8).equal(value.view(torch.uint8))
            assert same, f"{checkpoint_id}: tensor {key} differs"
        else:
            assert state[key] == value, f"{checkpoint_id}: item {key} differs"


def assert_audit_clean(config: Config) -> int:
    """``verify --all``: every committed copy in every tier checks out; the number of copies."""
    audits = audit_all(config, [0])
    bad = [f"{a.tier}/{a.checkpoint_id}: {'; '.join(a.problems)}" for a in audits if not a.ok]
    assert bad == [], f"a marker stands over missing or wrong data: {bad}"
    return len(audits)


def tier_files(tier: Tier, s3: Any) -> dict[str, int]:
    """Every file or object in the tier with its size, temporary names included (the tier's own
    listing hides them): walked on disk, or listed in the bucket behind tierstore's back."""
    root = real_path(tier)
    if root is not None:
        found: dict[str, int] = {}
        for directory, _dirs, names in os.walk(root):
            for name in names:
                full = Path(directory, name)
                found[full.relative_to(root).as_posix()] = full.stat().st_size
        return found
    bucket, prefix = tier.bucket, tier.prefix  # type: ignore[attr-defined]
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return {o["Key"][len(prefix) + 1 :]: o["Size"] for p in pages for o in p.get("Contents", [])}


def committed_generations(tier: Tier, files: dict[str, int]) -> dict[str, str]:
    """``{id: generation}`` of every readable marker among ``files``."""
    found: dict[str, str] = {}
    for path in files:
        checkpoint_id, _, name = path.partition("/")
        if name == MARKER_NAME:
            try:
                found[checkpoint_id] = read_manifest(tier, checkpoint_id, trust=MarkerTrust()).generation
            except (FileNotFoundError, IntegrityError):
                continue  # an unreadable marker commits nothing: its files count as leaked
    return found


def is_committed(parts: list[str], committed: dict[str, str]) -> bool:
    """Whether the path ``parts`` is a marker or a file of the generation a marker names."""
    if len(parts) == 2 and parts[1] == MARKER_NAME:
        return parts[0] in committed
    return len(parts) >= 3 and committed.get(parts[0]) == parts[1]


def leaked(tier: Tier, s3: Any) -> dict[str, int]:
    """The files of ``tier`` that no committed copy and no bookkeeping accounts for."""
    files = tier_files(tier, s3)
    committed = committed_generations(tier, files)
    out: dict[str, int] = {}
    for path, size in files.items():
        parts = path.split("/")
        if any(is_temporary(p) for p in parts) or path.startswith(f"{staging_dir()}/"):
            out[path] = size
        elif parts[0] != INTERNAL_DIR and not is_committed(parts, committed):
            out[path] = size  # (under INTERNAL_DIR: the tier's records, cleaned on their terms)
    return out


def open_upload_count(config: Config, s3: Any) -> tuple[int, int]:
    """Multipart uploads left in the buckets of ``config``'s S3 tiers, and their parts' bytes."""
    count = size = 0
    for tier in config.make_tiers(node=0):
        if tier.local is not None:
            continue
        bucket = tier.bucket  # type: ignore[attr-defined]
        for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            count += 1
            parts = s3.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            size += sum(p["Size"] for p in parts.get("Parts", []))
    return count, size


def leaked_bytes(config: Config, s3: Any) -> tuple[int, list[str]]:
    """Bytes leaked over every tier of ``config`` (files, plus parts of open uploads), and what."""
    total, what = 0, []
    for tier in config.make_tiers(node=0):
        for path, size in sorted(leaked(tier, s3).items()):
            total += size
            what.append(f"{tier.name}:{path} ({size} B)")
    uploads, parts = open_upload_count(config, s3)
    if uploads:
        what.append(f"{uploads} open multipart uploads ({parts} B)")
    return total + parts, what
