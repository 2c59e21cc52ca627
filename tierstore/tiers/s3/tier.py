"""``s3`` tier: a bucket/prefix on AWS S3 or any S3-compatible endpoint, through fsspec/s3fs.

Provider quirks stay here: s3fs's own retry loop and botocore's are switched off so that the tier's
:class:`~tierstore.tiers.s3.retry.RetryPolicy` is the only one (and decides by error codes, not message
text); listings are never cached (another process writes here); botocore's default request checksum
is off (some S3-compatible stores reject it; integrity is checked with our CRC32C). Provider errors are
translated once, in :meth:`S3Tier.call`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

import botocore.exceptions

from tierstore._platform.runtime import keep_inherited, track
from tierstore.errors import TierMisconfiguredError, TierUnavailableError
from tierstore.tiers.base import Capabilities, FileInfo, IncompleteWrite, Tier, WriteStream
from tierstore.tiers.s3.fields import S3Fields
from tierstore.tiers.s3.listing import ROLL_UP, named_in_children
from tierstore.tiers.s3.retry import RetriesExhausted, RetryPolicy, is_connection_failure, s3_error
from tierstore.tiers.s3.upload import ObjectUpload, S3WriteStream, checksum_args

logger = logging.getLogger(__name__)

_READ_SLICE = 2**20
"""Bytes taken from a response at a time (see :meth:`S3Tier.read_into`)."""

_LOADER: Any = None
"""botocore's data loader, shared by every tier's session in this process: it caches the parsed
service model (parsing it costs about 0.1 s of CPU per new session). Only the loader is shared:
a session keeps the first credentials it resolves, and every tier must resolve its own, as they
are at the time (rotated keys, another profile)."""


REFUSALS = {
    "AccessDenied": "the credentials may not do this (check the bucket policy and the key's permissions)",
    "InvalidAccessKeyId": "the access key is unknown to this endpoint",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "AllAccessDisabled": "all access to the bucket is disabled",
    "AccountProblem": "the account cannot be used",
    "InvalidBucketName": "the bucket name is not valid",
}
"""S3 answers that waiting will not change: a configuration or credentials to fix, not an outage."""


class S3Tier(Tier):
    """An S3 prefix: ``s3://bucket/prefix/<namespace>``. Global scope (never node-local)."""

    node_local = False
    type = "s3"

    def __init__(self, config: S3Fields, *, namespace: str | None) -> None:
        self.name = config.name
        self.config = config
        bucket, _, prefix = config.url.removeprefix("s3://").partition("/")
        self.bucket = bucket
        self.prefix = "/".join(p for p in (prefix.strip("/"), namespace) if p)
        self.root = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.part_size = config.part_size
        self.concurrency = config.concurrency
        self.policy = RetryPolicy(config.max_attempts, config.max_retry_time)
        self.on_retry: Callable[[BaseException], None] | None = None
        self.capabilities = Capabilities(
            transfer_chunk=config.part_size,
            transfer_streams=config.concurrency,
            read_chunk=config.read_size,
            read_streams=config.read_concurrency,
            listing_page=1000,  # ListObjectsV2's most keys per page
        )
        self.send_checksums = config.checksum != "none"
        self.part_checksum = {"crc32": "CRC32", "crc32c": "CRC32C"}.get(config.checksum)
        """Each multipart part's checksum: CRC32C by default, computed 5x faster than CRC32 here
        (hardware instructions; zlib's CRC32 took a sixth of the client's CPU in an upload).
        Whole objects (markers, records) keep CRC32, which botocore checks on a whole-object read
        without the CRT; a multipart object's checksum (of checksums) is never checked on read."""
        self._new_process_state()

    def _new_process_state(self) -> None:
        """Clients (made on first use), their lock and the part slots: never shared by processes."""
        self._fs: Any = None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.part_slots = threading.BoundedSemaphore(self.concurrency)
        track(self)

    def _forget_in_child(self) -> None:
        """In a forked child: clients, a lock and part slots of its own.

        The parent's botocore client holds its keep-alive sockets, which the child would share; its
        s3fs filesystem refuses to run after a fork; and a lock or part slot held by one of its
        threads at the fork would never be released in the child, where that thread does not exist.
        The parent's clients are kept, never used nor closed (see
        :func:`tierstore._platform.runtime.keep_inherited`).
        """
        keep_inherited((self._client, self._fs))
        self._new_process_state()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["on_retry"] = None
        for name in ("_fs", "_client", "_client_lock", "part_slots"):
            del state[name]  # per process (see _new_process_state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_process_state()

    @property
    def fs(self) -> Any:
        """The s3fs filesystem (created on first use, never shared with other tiers)."""
        if self._fs is None:
            import s3fs

            config_kwargs: dict[str, Any] = {
                "retries": {"total_max_attempts": 1},
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
                "read_timeout": self.config.read_timeout,
            }
            client_kwargs = {"region_name": self.config.region} if self.config.region else {}
            fs = s3fs.S3FileSystem(
                endpoint_url=self.config.endpoint_url,
                client_kwargs=client_kwargs,
                config_kwargs=config_kwargs,
                skip_instance_cache=True,
                use_listings_cache=False,
                max_concurrency=self.concurrency,
            )
            fs.retries = 1  # one attempt inside s3fs: retries are ours (RetryPolicy)
            self._fs = fs
        return self._fs

    @property
    def client(self) -> Any:
        """A botocore client for uploads and bulk reads (created once, on first use; thread-safe).

        Uploads bypass s3fs on purpose: aiobotocore signs every request body (SHA-256 over plain
        HTTP) on its one event-loop thread, serialising the parts in flight; botocore does it on
        the uploading threads. Measured: 8 concurrent 64 MiB parts 1.25-1.7x faster (README).
        """
        with self._client_lock:  # the first use is often from many part or range threads at once
            if self._client is None:
                self._client = self._new_client()
        return self._client

    def _new_client(self) -> Any:
        import botocore.config
        import botocore.session

        config = botocore.config.Config(
            retries={"total_max_attempts": 1},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, 2 * max(self.concurrency, self.config.read_concurrency)),
            read_timeout=self.config.read_timeout,
            **self._payload_signing(),
        )
        global _LOADER
        session = botocore.session.Session()
        if _LOADER is None:  # two threads may both set it: harmless, either one serves
            _LOADER = session.get_component("data_loader")
        session.register_component("data_loader", _LOADER)
        return session.create_client(
            "s3", endpoint_url=self.config.endpoint_url, region_name=self.config.region, config=config
        )

    def _payload_signing(self) -> dict[str, Any]:
        """botocore's ``s3`` setting for body signing: unsigned where a checksum travels with it.

        Over plain HTTP botocore hashes every body with SHA-256 for the signature (over HTTPS it
        already sends a part with a checksum unsigned): about 0.7 s of the client's CPU per GiB,
        a third of what an upload cost it. The store refuses a body that does not match its
        CRC32C or CRC32 (``BadDigest``) either way, so damage on the way is caught without the
        hash; what the signature adds on plain HTTP is a guard against deliberate tampering,
        which ``sign_payload`` keeps. The completion's part list goes unsigned too: the store
        matches each part it names against the part's ETag and checksum. Without checksums
        (``checksum: none``) a body has no other check: it stays signed."""
        if self.config.sign_payload or not self.send_checksums:
            return {}
        return {"s3": {"payload_signing_enabled": False}}

    def _key(self, path: str) -> str:
        return "/".join(p for p in (self.prefix, path) if p)

    def _full(self, path: str) -> str:
        return f"{self.bucket}/{self._key(path)}".rstrip("/")

    def call(self, method: str, what: str, **kwargs: Any) -> Any:
        """One S3 API call through the retry policy, with errors translated (see module doc)."""

        def operation() -> Any:
            try:
                return getattr(self.client, method)(**kwargs)
            except botocore.exceptions.ClientError as exc:
                raise _as_builtin(exc) from exc

        return self._guard(what, operation)

    def _guard(self, what: str, operation: Any) -> Any:
        try:
            return self.policy.call(operation, what=f"{self.name}: {what}", on_retry=self.on_retry)
        except (FileExistsError, EOFError):
            raise
        except FileNotFoundError as exc:
            if (s3_error(exc) or (0, ""))[1] == "NoSuchBucket":
                raise self._misconfigured(what, f"bucket {self.bucket!r} does not exist") from exc
            raise
        except botocore.exceptions.NoCredentialsError as exc:
            raise self._misconfigured(
                what, "no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)"
            ) from exc
        except Exception as exc:
            last: BaseException = exc
            tries = ""
            if isinstance(exc, RetriesExhausted):  # name the last failure, then the attempts
                last, tries = exc.__cause__ or exc, f" ({exc.summary})"
            answer = s3_error(exc)
            if is_connection_failure(exc):
                endpoint = self.config.endpoint_url or "the AWS endpoint"
                reason = f"cannot reach {endpoint}{tries}: {last}"
            elif answer is not None and (answer[1] in REFUSALS or answer[0] == 403):
                why = REFUSALS.get(answer[1], REFUSALS["AccessDenied"])  # a HEAD's 403 has no body
                refused = f"S3 answered {answer[1] if answer[1] in REFUSALS else 'AccessDenied'}"
                raise self._misconfigured(what, f"{refused} (HTTP {answer[0]}): {why}") from exc
            elif answer is not None:
                reason = f"S3 answered {answer[1] or 'an error'} (HTTP {answer[0]}){tries}"
            elif tries:
                reason = f"{last}{tries}"
            else:
                raise
            if tries:
                reason += "; check the endpoint, or raise the tier's max_attempts / max_retry_time"
            raise self._unavailable(what, reason) from exc

    def _unavailable(self, what: str, reason: str) -> TierUnavailableError:
        return TierUnavailableError(f"tier {self.describe()}: {what}: {reason}", tier=self.name)

    def _misconfigured(self, what: str, reason: str) -> TierMisconfiguredError:
        return TierMisconfiguredError(f"tier {self.describe()}: {what}: {reason}", tier=self.name)

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
        upload = ObjectUpload(self, self.bucket, self._key(path))
        stream = S3WriteStream(upload, self.part_size)
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
            self.call(
                "delete_object", f"delete failed upload {path}", Bucket=self.bucket, Key=self._key(path)
            )
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
            checksum = checksum_args(data) if self.send_checksums else {}
            self.call(
                "put_object",
                f"publish {path}",
                Bucket=self.bucket,
                Key=self._key(path),
                Body=data,
                **match,
                **checksum,
            )
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
                return bytes(self.fs.cat_file(self._full(path), start=offset, end=end))
            except Exception as exc:
                # S3 answers a range that starts at the end (any range of an empty object) with
                # 416: zero bytes, not an unavailable tier (a marker cut to nothing is corrupt).
                if (s3_error(exc) or (0, ""))[1] == "InvalidRange":
                    return b""
                raise

        return bytes(self._guard(f"read {path}", get))

    def _read_whole(self, path: str) -> bytes:
        """One GET of the whole object (a marker, ``.metadata``, a record), checked against the
        checksum the store keeps for it where it sends one (botocore compares it once the body is
        read): a body damaged on the way raises, and the retry policy fetches it again."""
        key = self._key(path)

        def get() -> bytes:
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
            except botocore.exceptions.ClientError as exc:
                error = _as_builtin(exc)
                if isinstance(error, FileNotFoundError):
                    raise FileNotFoundError(f"{self.root}/{path}: {error}") from exc
                raise error from exc
            body = answer["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return bytes(self._guard(f"read {path}", get))

    def read_into(self, path: str, offset: int, out: memoryview | Sequence[memoryview]) -> None:
        """One ranged GET whose body is streamed into ``out`` in order (``EOFError`` if the object
        is shorter): a run of tensors lands in their own memory, no buffer between.

        Bulk reads bypass s3fs for the reason uploads do (see :attr:`client`): its one event-loop
        thread serialises the GETs in flight, where botocore reads on the calling threads.
        """
        outs = [out] if isinstance(out, memoryview) else out
        total = sum(len(out) for out in outs)
        if not total:
            return
        key, last = self._key(path), offset + total - 1

        def operation() -> None:
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{last}")
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) == "InvalidRange":
                    raise EOFError(f"{self.root}/{path}: nothing at {offset}") from exc
                error = _as_builtin(exc)
                if isinstance(error, FileNotFoundError):
                    raise FileNotFoundError(f"{self.root}/{path}: {error}") from exc
                raise error from exc
            body, filled = answer["Body"], 0
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

        self._guard(f"read {path}", operation)

    def stat(self, path: str) -> FileInfo:
        """HEAD the object: one request, found or not. (s3fs's ``info`` lists the prefix as well
        when the key is missing, to tell a directory: a second request for every ``exists`` that
        finds nothing, and the commit protocol asks many of those on every save.)"""
        try:
            answer = self.call("head_object", f"stat {path}", Bucket=self.bucket, Key=self._key(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.root}/{path}") from None
        return FileInfo(path, int(answer["ContentLength"]), _mtime(answer))

    def list_dir(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (objects and common prefixes)."""
        try:
            names = self._guard(f"list {path or '/'}", lambda: self.fs.ls(self._full(path), detail=False))
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
            page = self.call("list_objects_v2", what, Bucket=self.bucket, **kwargs)
            found += [
                FileInfo(str(item["Key"])[strip:], int(item["Size"]), _mtime(item))
                for item in page.get("Contents", [])
                if not str(item["Key"]).endswith("/")
            ]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(found, key=lambda f: f.path)
            kwargs["ContinuationToken"] = token

    def find_in_children(self, name: str) -> dict[str, FileInfo]:
        """Each child's ``name`` without paging through the data between them: the generation
        directories are rolled up by a delimiter (:mod:`tierstore.tiers.s3.listing`)."""
        if name.startswith(ROLL_UP[1:]):
            return super().find_in_children(name)
        prefix = f"{self.prefix}/" if self.prefix else ""

        def list_page(kwargs: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = self.call(
                "list_objects_v2", f"list {name} of each child", Bucket=self.bucket, **kwargs
            )
            return answer

        return named_in_children(list_page, prefix, name, _mtime)

    def delete(self, path: str) -> None:
        """DELETE one object (absent is fine). Through the botocore client, not s3fs: a save's
        last request removes its write-activity record, and through s3fs that built the
        aiobotocore client and its event loop for this one request (60 ms after the marker)."""
        with contextlib.suppress(FileNotFoundError):
            self.call("delete_object", f"delete {path}", Bucket=self.bucket, Key=self._key(path))

    def delete_tree(self, path: str) -> None:
        """Delete every object under ``path``."""
        for info in self.find(path):
            self.delete(info.path)

    def observe_retries(self, callback: Callable[[BaseException], None] | None) -> None:
        """Tell ``callback`` about every transient error that is retried."""
        self.on_retry = callback

    def incomplete_writes(self, *, idle_for: float, now: float) -> list[IncompleteWrite]:
        """Incomplete multipart uploads under this tier's prefix whose last part is ``idle_for`` old.

        An upload's activity is its newest part (``ListParts``), not when it started: a long upload
        still receiving parts is in progress.
        """
        prefix = f"{self.prefix}/" if self.prefix else ""  # not a sibling namespace's uploads
        answer = self.call("list_multipart_uploads", "list uploads", Bucket=self.bucket, Prefix=prefix)
        found: list[IncompleteWrite] = []
        for upload in answer.get("Uploads", []):
            started: datetime | None = upload.get("Initiated")
            activity = started.timestamp() if started else now - idle_for
            if now - activity >= idle_for:
                parts = self.call(
                    "list_parts",
                    "list parts",
                    Bucket=self.bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
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
            self.call(
                "abort_multipart_upload",
                f"abort upload of {write.path}",
                Bucket=self.bucket,
                Key=self._key(write.path),
                UploadId=write.handle,
            )


def _as_builtin(error: botocore.exceptions.ClientError) -> Exception:
    """The builtin error a raw S3 answer means below the seam (as s3fs translates them), else itself."""
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    code = str(error.response.get("Error", {}).get("Code", ""))
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
        return FileExistsError(f"{code or status}: the name is taken")
    if code in ("NoSuchKey", "NoSuchBucket", "NotFound") or status == 404:
        return FileNotFoundError(f"{code or status}")
    unchanged: Exception = error
    return unchanged


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
