"""tierstore's errors: one root, a few shallow families.

Below the tier seam, adapters raise Python's builtins (``FileNotFoundError``, ``FileExistsError``,
``OSError``); above it, callers see these. Every class derives from :class:`Exception` (never
``BaseException``), so ``except Exception`` and ``except TierstoreError`` both catch them. Messages name
the file, key, tier or object involved and what was expected.
"""

from __future__ import annotations


class TierstoreError(Exception):
    """Root of every error tierstore raises on purpose."""


class ConfigError(TierstoreError):
    """The YAML configuration is malformed, incomplete or names something unusable.

    The message has the form ``FILE: KEY: what was expected``.
    """


class InvalidCheckpointIdError(TierstoreError, ValueError):
    """A checkpoint id is not a plain name (``[A-Za-z0-9._-]+``, not ``.``, ``..`` or reserved)."""


class CheckpointNotFoundError(TierstoreError):
    """No tier holds a usable committed copy of the checkpoint; the message lists every tier and why."""


class CheckpointExistsError(TierstoreError):
    """The checkpoint id is already committed in the target tier and overwrite was not requested."""


class IntegrityError(TierstoreError):
    """Stored bytes do not match their commit marker (missing file, wrong size, CRC32C mismatch)."""


class StaleStagedStateError(TierstoreError):
    """A save was given a staged state whose staging buffer has since been staged into again (a later
    ``stage()``/``async_save`` to the same tier in this process): it would write the later state's
    bytes. A staged state is good until the next stage; stage the state again to save it."""


class TierUnavailableError(TierstoreError):
    """A tier cannot be reached or used: unreachable endpoint, missing bucket, unwritable path,
    disk full. ``tier`` is the name of the tier that refused (None when unknown). ``outage``: the
    tier did not answer at all (connection refused, no answer within a deadline, 5xx past the
    retries), which opens its breaker in this process (:mod:`tierstore._platform.health`); a full
    disk or a refused credential is not an outage."""

    def __init__(self, message: str, *, tier: str | None = None, outage: bool = False) -> None:
        super().__init__(message)
        self.tier = tier
        self.outage = outage


class TierMisconfiguredError(TierUnavailableError):
    """A tier that waiting will not cure: its bucket does not exist, its credentials are missing or
    refused, access is denied. Not an outage: a promoter stops at start, and reports not ready."""


class CommitVetoedError(TierstoreError):
    """A commit gate refused the checkpoint; nothing was committed and the previous one stays latest."""


class NonFiniteTensorError(CommitVetoedError):
    """``check_finite`` found NaN or Inf in a floating-point tensor; the message names the tensor."""


def one_line(message: str) -> str:
    """``message`` on one line, for a terminal or a log line: its lines stripped and joined with
    ``"; "``, except after a line ending with ``:`` (a heading and the list under it read as one
    sentence: ``no tier holds ...: memory (...): no commit marker; s3 (...): ...``)."""
    joined = ""
    for line in (part.strip() for part in message.splitlines()):
        if not line:
            continue
        if joined:
            joined += " " if joined.endswith(":") else "; "
        joined += line
    return joined
