"""``s3`` tier: a bucket/prefix on AWS S3 or any S3-compatible endpoint, through botocore and s3fs.

Its requests, retries and error translation are its :class:`~tierstore.tiers.s3.client.S3Client`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import botocore.exceptions

from tierstore._platform.bounded import beat
from tierstore.errors import TierUnavailableError
from tierstore.tiers.base import Capabilities, FileInfo, IncompleteWrite, RetryHook, Tier, WriteStream
from tierstore.tiers.s3.client import S3Client, as_builtin
from tierstore.tiers.s3.fields import S3Fields
from tierstore.tiers.s3.listing import ROLL_UP, named_in_children
from tierstore.tiers.s3.retry import s3_error
from tierstore.tiers.s3.upload import ObjectUpload, S3WriteStream, checksum_args

logger = logging.getLogger(__name__)

_READ_SLICE = 2**20
"""Bytes taken from a response at a time (see :meth:`S3Tier.read_into`)."""


class S3Tier(Tier):
    """An S3 prefix: ``s3://bucket/prefix/<namespace>``. Global scope (never node-local)."""

    node_local = False
    type = "s3"

    def __init__(self, config: S3Fields, *, namespace: str | None, on_retry: RetryHook | None = None) -> None:
        self.name = config.name
        self.config = config
        bucket, _, prefix = config.url.removeprefix("s3://").partition("/")
        self.bucket = bucket
        self.prefix = "/".join(p for p in (prefix.strip("/"), namespace) if p)
        self.root = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.s3 = S3Client(config, label=self.describe(), bucket=bucket, on_retry=on_retry)
        """Its requests (told to ``on_retry``: each transient error retried)."""
        self.capabilities = Capabilities(
            transfer_chunk=config.part_size,
            transfer_streams=config.concurrency,
            read_chunk=config.read_size,
            read_streams=config.read_concurrency,
            listing_page=1000,  # ListObjectsV2's most keys per page
        )

    @property
    def health_key(self) -> str:
        """The endpoint too: one bucket may be reached through several (a proxy, a region)."""
        return f"s3 {self.config.endpoint_url or 'aws'} {self.root}"

    def _key(self, path: str) -> str:
        return "/".join(p for p in (self.prefix, path) if p)

    def _full(self, path: str) -> str:
        return f"{self.bucket}/{self._key(path)}".rstrip("/")

    def open_write(self, path: str) -> contextlib.AbstractContextManager[WriteStream]:
        """Buffer and upload part by part; the object appears only when the block exits normally.

        A failed upload leaves nothing visible, even when the store did the finishing request but
        every answer to it was an error: the object is then deleted (see :meth:`_upload`).
        """
        return self._upload(path, discard=True)

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        """Write ``data`` to ``path`` in one upload; a failure never deletes what is at ``path``.

        Records are rewritten in place (an activity record's heartbeat, a sighting): when the PUT
        fails, the object there may be the previous version, whose loss would let cleanup take a
        generation still in use. So it is kept: either version is a whole, valid record.
        """
        with self._upload(path, discard=False) as stream:
            stream.write(data)

    @contextlib.contextmanager
    def _upload(self, path: str, *, discard: bool) -> Iterator[WriteStream]:
        """The upload behind :meth:`open_write`; with ``discard``, a failure whose finishing
        request was sent deletes the key (the store may have done it, answering an error)."""
        upload = ObjectUpload(self.s3, self._key(path))
        stream = S3WriteStream(upload, self.s3.part_size)
        try:
            yield stream
            stream.close()
        except BaseException as exc:
            upload.abort()
            if discard and upload.finishing_sent and isinstance(exc, Exception):
                self._discard(path)
            raise

    def _discard(self, path: str) -> None:
        """Best-effort delete of a failed upload's object: the keys written through
        :meth:`open_write` (data files) are new to each write, so it can only be this write's."""
        try:
            self.s3.call("delete_object", f"delete failed upload {path}", Key=self._key(path))
        except Exception as exc:  # noqa: BLE001 - the write's own error is the one to raise
            logger.warning(
                "tier %s: could not delete %s after its upload failed (it may be visible): %s",
                self.describe(),
                path,
                exc,
            )

    def publish(self, path: str, data: bytes, *, create_only: bool) -> None:
        """One PUT; with ``create_only`` (and ``create_only_markers``) ``If-None-Match: *``."""
        match = {"IfNoneMatch": "*"} if create_only and self.config.create_only_markers else {}
        if create_only and not match and self.exists(path):
            raise FileExistsError(f"{self.root}/{path}")
        try:
            # With its checksum, a marker damaged on the way is refused (and sent again), not committed.
            checksum = checksum_args(data) if self.s3.send_checksums else {}
            self.s3.call("put_object", f"publish {path}", Key=self._key(path), Body=data, **match, **checksum)
        except FileExistsError:
            # A retried create-only PUT can find its own first attempt: that is success.
            with contextlib.suppress(FileNotFoundError):
                if self.read_bytes(path) == data:
                    return
            raise
        except TierUnavailableError as exc:
            # An error answer does not prove the PUT undone (the store may have done it, then
            # failed to say so): what stands tells. Only asked when the store answered at all.
            standing = self._standing(path) if s3_error(exc) is not None else None
            if standing == data:
                return
            if create_only and standing is not None:  # another writer's: the name is taken
                raise FileExistsError(f"{self.root}/{path}") from exc
            raise TierUnavailableError(
                f"{exc}; whether {self.root}/{path} was written is unknown", tier=self.name
            ) from exc

    def _standing(self, path: str) -> bytes | None:
        """What ``path`` holds now; None when it is absent or cannot be read."""
        try:
            return self.read_bytes(path)
        except (FileNotFoundError, TierUnavailableError):
            return None

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """A ranged GET (``FileNotFoundError`` when the object is absent); past the end, or of an
        empty object, no bytes (as a short file reads on POSIX)."""
        if offset == 0 and length is None:
            return self._read_whole(path)
        end = None if length is None else offset + length

        def get() -> bytes:
            try:
                return bytes(self.s3.fs.cat_file(self._full(path), start=offset, end=end))
            except Exception as exc:
                # S3 answers a range that starts at the end (any range of an empty object) with
                # 416: zero bytes, not an unavailable tier (a marker cut to nothing is corrupt).
                if (s3_error(exc) or (0, ""))[1] == "InvalidRange":
                    return b""
                raise

        return bytes(self.s3.guard(f"read {path}", get))

    def _read_whole(self, path: str) -> bytes:
        """One GET of the whole object (a marker, ``.metadata``, a record), checked against the
        checksum the store keeps for it where it sends one (botocore compares it once the body is
        read): a body damaged on the way raises, and the retry policy fetches it again."""

        def get() -> bytes:
            body = self._get(path, ChecksumMode="ENABLED")["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return bytes(self.s3.guard(f"read {path}", get))

    def read_into(self, path: str, offset: int, out: memoryview | Sequence[memoryview]) -> None:
        """One ranged GET whose body is streamed into ``out`` in order (``EOFError`` if the object
        is shorter): a run of tensors lands in their own memory, no buffer between.

        Bulk reads bypass s3fs for the reason uploads do (see :attr:`S3Client.client`): its one event-loop
        thread serialises the GETs in flight, where botocore reads on the calling threads.
        """
        outs = [out] if isinstance(out, memoryview) else out
        total = sum(len(out) for out in outs)
        if not total:
            return
        last = offset + total - 1

        def operation() -> None:
            body, filled = self._get(path, Range=f"bytes={offset}-{last}")["Body"], 0
            try:
                for buffer in outs:
                    filled += _fill(body, buffer.cast("B"))
            except botocore.exceptions.IncompleteReadError as exc:
                # The server closed the response early: retried like a reset connection.
                raise ConnectionError(f"{self.root}/{path}: response cut short: {exc}") from exc
            finally:
                body.close()
            if filled != total:
                raise EOFError(f"{self.root}/{path}: {filled} of {total} bytes at {offset}")

        self.s3.guard(f"read {path}", operation)

    def _get(self, path: str, **kwargs: Any) -> Any:
        """One GET of ``path``'s object; an error answer as a builtin naming it (a range past its end:
        ``EOFError``)."""
        try:
            return self.s3.client.get_object(Bucket=self.bucket, Key=self._key(path), **kwargs)
        except botocore.exceptions.ClientError as exc:
            error: Exception = as_builtin(exc)
            if str(exc.response.get("Error", {}).get("Code", "")) == "InvalidRange":
                error = EOFError(f"{self.root}/{path}: nothing at {kwargs.get('Range')}")
            elif isinstance(error, FileNotFoundError):
                error = FileNotFoundError(f"{self.root}/{path}: {error}")
            raise error from exc

    def stat(self, path: str) -> FileInfo:
        """HEAD the object: one request, found or not. (s3fs's ``info`` lists the prefix as well
        when the key is missing, to tell a directory: a second request for every ``exists`` that
        finds nothing, and the commit protocol asks many of those on every save.)"""
        try:
            answer = self.s3.call("head_object", f"stat {path}", Key=self._key(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.root}/{path}") from None
        return FileInfo(path, int(answer["ContentLength"]), _mtime(answer))

    def list_dir(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (objects and common prefixes)."""
        try:
            names = self.s3.guard(
                f"list {path or '/'}", lambda: self.s3.fs.ls(self._full(path), detail=False)
            )
        except FileNotFoundError:
            return []
        return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names})

    def find(self, path: str = "", *, after: str | None = None) -> list[FileInfo]:
        """Every object under ``path`` (a request per 1,000 objects listed; nothing cached), from
        ``after`` on (``StartAfter``).

        Through the botocore client, not s3fs: a tier's first listing through s3fs builds its
        aiobotocore client and event loop (about 65 ms of CPU), and a save or restore of a new
        writer or reader lists its tier's records before its first byte."""
        start = {} if after is None else {"StartAfter": self._key(after)}
        return self._listed(f"list {path or '/'}", self._under(path), start)

    def _under(self, path: str) -> str:
        """The key prefix of everything under ``path`` (the whole tier for ``""``)."""
        key = self._key(path)
        return f"{key}/" if key else ""

    def _listed(self, what: str, prefix: str, kwargs: dict[str, Any]) -> list[FileInfo]:
        """The objects whose keys start with ``prefix`` (``kwargs``: more ListObjectsV2
        arguments), by path, paginated; keys ending in ``/`` (folder placeholders) left out."""
        strip = len(self._key("")) + 1 if self.prefix else 0
        kwargs = {"Prefix": prefix, **kwargs}
        found: list[FileInfo] = []
        while True:
            page = self.s3.call("list_objects_v2", what, **kwargs)
            found += [
                FileInfo(str(item["Key"])[strip:], int(item["Size"]), _mtime(item))
                for item in page.get("Contents", [])
                if not str(item["Key"]).endswith("/")
            ]
            beat()  # a page: a long listing is progress to whoever bounds it
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(found, key=lambda f: f.path)
            kwargs["ContinuationToken"] = token

    def find_in_children(self, name: str, *, besides: str | None = None) -> dict[str, FileInfo]:
        """Each child's ``name`` without paging through the data between them: the generation
        directories are rolled up by a delimiter, the keys of ``besides`` skipped by one jump
        (:mod:`tierstore.tiers.s3.listing`)."""
        if name.startswith(ROLL_UP[1:]):
            return super().find_in_children(name, besides=besides)
        prefix = f"{self.prefix}/" if self.prefix else ""

        def list_page(kwargs: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = self.s3.call("list_objects_v2", f"list {name} of each child", **kwargs)
            return answer

        return named_in_children(list_page, prefix, name, _mtime, besides=besides)

    def delete(self, path: str) -> None:
        """DELETE one object (absent is fine). Through the botocore client, not s3fs: a save's
        last request removes its write-activity record, and through s3fs that built the
        aiobotocore client and its event loop for this one request (60 ms after the marker)."""
        with contextlib.suppress(FileNotFoundError):
            self.s3.call("delete_object", f"delete {path}", Key=self._key(path))

    def delete_tree(self, path: str) -> None:
        """Delete every object under ``path``."""
        for info in self.find(path):
            self.delete(info.path)

    def incomplete_writes(self, *, idle_for: float, now: float) -> list[IncompleteWrite]:
        """Incomplete multipart uploads under this tier's prefix whose last part is ``idle_for`` old.

        An upload's activity is its newest part (``ListParts``), not when it started: a long upload
        still receiving parts is in progress.
        """
        prefix = f"{self.prefix}/" if self.prefix else ""  # not a sibling namespace's uploads
        answer = self.s3.call("list_multipart_uploads", "list uploads", Prefix=prefix)
        found: list[IncompleteWrite] = []
        for upload in answer.get("Uploads", []):
            started: datetime | None = upload.get("Initiated")
            activity = started.timestamp() if started else now - idle_for
            if now - activity >= idle_for:
                parts = self.s3.call(
                    "list_parts", "list parts", Key=upload["Key"], UploadId=upload["UploadId"]
                )
                activity = max([activity, *(_mtime(p) for p in parts.get("Parts", []))])
            if now - activity >= idle_for:
                key = str(upload["Key"])
                path = key[len(prefix) :] if key.startswith(prefix) else key
                found.append(IncompleteWrite(path, activity, "multipart upload", str(upload["UploadId"])))
        return found

    def discard_incomplete(self, write: IncompleteWrite) -> None:
        """Abort an incomplete multipart upload (S3 frees its parts)."""
        if not write.handle:
            self.delete(write.path)
            return
        with contextlib.suppress(FileNotFoundError):
            self.s3.call(
                "abort_multipart_upload",
                f"abort upload of {write.path}",
                Key=self._key(write.path),
                UploadId=write.handle,
            )


def _mtime(info: dict[str, Any]) -> float:
    stamp: Any = info.get("LastModified") or info.get("last_modified")
    return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else 0.0


def _fill(body: Any, out: memoryview) -> int:
    """Read from ``body`` into ``out`` until it is full or the body ends; the bytes read.

    Small slices: urllib3 reads a readinto() request into a temporary bytes object first, so one
    call for a whole range would hold the range twice.
    """
    filled = 0
    while filled < len(out):
        got = body.readinto(out[filled : filled + _READ_SLICE])
        if not got:
            break
        filled += got
    return filled
