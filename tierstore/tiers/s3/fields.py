"""The ``s3`` tier type's YAML fields and their checks (:mod:`.config` registers the type)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from tierstore.tiers.base import TierConfig
from tierstore.units import Duration, Size


class S3Fields(TierConfig):
    """An S3 bucket/prefix (AWS or any S3-compatible endpoint). Global: never node-local."""

    type: Literal["s3"]
    url: str = Field(description="s3://bucket[/prefix]")
    endpoint_url: str | None = Field(None, description="For S3-compatible stores.")
    region: str | None = None
    part_size: Annotated[Size, Field(ge=5 * 2**20, le=5 * 2**30)] = Field(
        8 * 2**20, description="Multipart part size (S3 allows 5 MiB to 5 GiB); it doubles every 1,000 parts."
    )
    concurrency: int = Field(16, ge=1, le=256, description="Parts in flight per file.")
    read_size: Annotated[Size, Field(ge=2**20, le=5 * 2**30)] = Field(
        64 * 2**20, description="The byte ranges a restore reads an object in."
    )
    read_concurrency: int = Field(8, ge=1, le=256, description="Ranges read at once per file.")
    max_attempts: int = Field(8, ge=1, le=100, description="Attempts per idempotent request.")
    max_retry_time: Duration = Field(120.0, description="Bound on one request's retries.")
    read_timeout: Duration = Field(
        60.0, description="Wait this long for each answer (or its next bytes); then retry."
    )
    checksum: Literal["crc32c", "crc32", "none"] = Field(
        "crc32c",
        description=(
            "Send a checksum with every body (the store verifies it): crc32c, a CRC32C with each"
            " multipart part and a CRC32 with each whole object; crc32, CRC32 with both (stores"
            " that take no CRC32C); none for stores that reject checksums."
        ),
    )
    sign_payload: bool = Field(
        False,
        description=(
            "Also sign request bodies with SHA-256 where botocore would (plain HTTP). Off: with"
            " a checksum every body goes as UNSIGNED-PAYLOAD, as botocore sends parts over"
            " HTTPS; the store still refuses damaged bytes by their checksum, and the client saves"
            " about 0.7 s of CPU per GiB. Without checksums bodies are always signed."
        ),
    )
    create_only_markers: bool = Field(
        True, description="Publish markers with If-None-Match: * (stores that support it)."
    )

    @field_validator("url")
    @classmethod
    def _is_s3_url(cls, value: str) -> str:
        if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?", value):
            raise ValueError(f"expected s3://bucket[/prefix], got {value!r}")
        return value.rstrip("/")

    @field_validator("endpoint_url")
    @classmethod
    def _is_http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", value):
            raise ValueError(f"expected http(s)://host[:port], got {value!r}")
        return value
