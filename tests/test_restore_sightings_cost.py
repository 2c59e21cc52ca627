"""What a restore from host memory asks of S3 when no promoter has left sightings anywhere: the
markers of the tiers it cannot otherwise know about, and no listing. A middle tier's sightings are
evidence only for a tier that does not answer (tierstore/dcp/restore/choice.py): while every tier
answers they are not read, which on an S3 middle tier would cost a listing per restore."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import torch
import torch.distributed.checkpoint as dcp

from tests.request_counter import CountingS3
from tierstore import TieredReader, TieredWriter
from tierstore.config import config_from_dict
from tierstore.records import known


def test_a_restore_from_memory_lists_nothing_in_s3_without_a_promoter(tmp_path: Path) -> None:
    with CountingS3() as s3:
        bucket = f"ts-{uuid.uuid4().hex[:16]}"
        boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=bucket)
        config = config_from_dict(
            {
                "tiers": [
                    {"name": "memory", "type": "memory", "path": str(tmp_path / "memory/{node}")},
                    {
                        "name": "regional",
                        "type": "s3",
                        "url": f"s3://{bucket}/regional",
                        "endpoint_url": s3.endpoint,
                    },
                    {
                        "name": "archive",
                        "type": "s3",
                        "url": f"s3://{bucket}/archive",
                        "endpoint_url": s3.endpoint,
                    },
                ]
            }
        )
        dcp.save({"w": torch.ones(8)}, storage_writer=TieredWriter(config), checkpoint_id="x")
        known._KNOWN.get().clear()  # a new process: nothing known of the S3 tiers
        target = {"w": torch.zeros(8)}
        reader = TieredReader(config)
        with s3.counting() as seen:
            dcp.load(target, storage_reader=reader, checkpoint_id="x")
        print(f"restore from {reader.chosen_tier}: {seen.total} S3 requests {seen.by_operation}")
        assert reader.chosen_tier == "memory" and torch.equal(target["w"], torch.ones(8))
        assert "GET list" not in seen.by_operation, seen.by_operation
