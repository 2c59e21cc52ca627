"""One S3 tier's connection: its clients, made on first use in each process, and every request
through the retry policy with provider errors translated once, here.

Provider quirks stay here: s3fs's own retry loop and botocore's are switched off so that the tier's
:class:`~tierstore.tiers.s3.retry.RetryPolicy` is the only one (and decides by error codes, not message
text); listings are never cached (another process writes here); botocore's default request checksum
is off (some S3-compatible stores reject it; integrity is checked with our CRC32C).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import botocore.exceptions

from tierstore._platform.runtime import keep_inherited, track
from tierstore.errors import TierMisconfiguredError, TierUnavailableError
from tierstore.tiers.base import RetryHook
from tierstore.tiers.s3.fields import S3Fields
from tierstore.tiers.s3.retry import (
    RetriesExhausted,
    RetryEpisode,
    RetryPolicy,
    is_connection_failure,
    s3_error,
)

T = TypeVar("T")

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
    "RequestTimeTooSkewed": "this machine's clock is too far from the endpoint's (synchronise it: NTP)",
}
"""S3 answers that waiting will not change: a configuration or credentials to fix, not an outage."""


class S3Client:
    """The clients of the tier ``name`` (``label``: the tier as messages name it) on ``bucket``,
    and its requests. What :class:`~tierstore.tiers.s3.upload.ObjectUpload` calls. ``on_retry`` is
    told of each transient error retried (this process only: a pickled copy drops it)."""

    def __init__(
        self, config: S3Fields, *, label: str, bucket: str, on_retry: RetryHook | None = None
    ) -> None:
        self.config, self.name, self.label, self.bucket = config, config.name, label, bucket
        self.part_size = config.part_size
        self.concurrency = config.concurrency
        self.policy = RetryPolicy(config.max_attempts, config.max_retry_time)
        self.on_retry = on_retry
        self.send_checksums = config.checksum != "none"
        self.part_checksum = {"crc32": "CRC32", "crc32c": "CRC32C"}.get(config.checksum)
        """Each multipart part's checksum: CRC32C by default, 5x faster than zlib's CRC32 (a sixth of
        an upload's CPU). Whole objects keep CRC32, which botocore checks on a whole-object read
        without the CRT; a multipart object's checksum (of checksums) is never checked on read."""
        self._new_process_state()

    def _new_process_state(self) -> None:
        """Clients (made on first use), their lock, the part slots and the retry episode: never shared
        by processes."""
        self._fs: Any = None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.part_slots = threading.BoundedSemaphore(self.concurrency)
        self.episode = RetryEpisode()
        track(self)

    def _forget_in_child(self) -> None:
        """In a forked child: clients, a lock and part slots of its own. The parent's botocore client
        would share its keep-alive sockets, its s3fs refuses to run after a fork, and a lock or slot
        a parent thread held would never be released here; the parent's clients are kept, never used
        nor closed (:func:`~tierstore._platform.runtime.keep_inherited`)."""
        keep_inherited((self._client, self._fs))
        self._new_process_state()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["on_retry"] = None
        for name in ("_fs", "_client", "_client_lock", "part_slots", "episode"):
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

        Over plain HTTP botocore hashes every body with SHA-256 for the signature (HTTPS sends a
        checksummed part unsigned already): 0.7 s of CPU per GiB, a third of an upload's. The store
        refuses a body that fails its CRC32C or CRC32 (``BadDigest``) either way; the signature adds
        a guard against deliberate tampering, which ``sign_payload`` keeps. The completion's part
        list goes unsigned too (the store matches each part's ETag and checksum). Without
        checksums (``checksum: none``) a body has no other check: it stays signed."""
        if self.config.sign_payload or not self.send_checksums:
            return {}
        return {"s3": {"payload_signing_enabled": False}}

    def call(self, method: str, what: str, **kwargs: Any) -> Any:
        """One S3 API call on the bucket through :meth:`guard`, its error answers as builtins
        (:func:`as_builtin`)."""

        def operation() -> Any:
            try:
                return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
            except botocore.exceptions.ClientError as exc:
                raise as_builtin(exc) from exc

        return self.guard(what, operation)

    def guard(self, what: str, operation: Callable[[], T]) -> T:
        """``operation()`` (idempotent) through the retry policy. ``FileNotFoundError``,
        ``FileExistsError`` and ``EOFError`` pass; a missing bucket, refused credentials or a 403 are
        :class:`TierMisconfiguredError`; an unreachable endpoint, an error answer or retries run
        out are :class:`TierUnavailableError`. Each names the tier and ``what``."""
        on_retry = self.on_retry
        try:
            return self.policy.call(
                operation,
                what=f"{self.name}: {what}",
                on_retry=None if on_retry is None else lambda error: on_retry(self.name, error),
                episode=self.episode,
            )
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
            raise TierUnavailableError(
                f"tier {self.label}: {what}: {reason}", tier=self.name, outage=True
            ) from exc

    def _misconfigured(self, what: str, reason: str) -> TierMisconfiguredError:
        return TierMisconfiguredError(f"tier {self.label}: {what}: {reason}", tier=self.name)


def as_builtin(error: botocore.exceptions.ClientError) -> Exception:
    """The builtin error a raw S3 answer means below the seam (as s3fs translates them), else itself."""
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    code = str(error.response.get("Error", {}).get("Code", ""))
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
        return FileExistsError(f"{code or status}: the name is taken")
    if code in ("NoSuchKey", "NoSuchBucket", "NotFound") or status == 404:
        return FileNotFoundError(f"{code or status}")
    unchanged: Exception = error
    return unchanged
