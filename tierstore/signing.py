"""The job's signing keys: HMAC-SHA256 over a marker's signed body, keys only from the environment.

Signing is optional. It is on when the environment variable named by ``signing.key_env`` (default
``TIERSTORE_SIGNING_KEY``) holds a key: writers then sign every marker, and every reader of markers
(restore, ``latest_committed``, the promoter, ``ls``, ``verify``, gc) refuses one that is unsigned or
signed with no accepted key; the keeper of a job-wide tier signs its index too, and its readers
refuse an unsigned one (:mod:`tierstore.records.index`). ``signing.verify_key_envs`` names older
keys still accepted (rotation); ``signing.require`` makes a missing key a
:class:`~tierstore.errors.ConfigError` instead of "off".

A key never leaves the process: it is not kept in the configuration, not written anywhere, not in any
message, ``repr`` or pickle (a pickled :class:`SigningKeys` is rebuilt from the environment of the
process that unpickles it, e.g. the daemon process of a PROCESS-mode ``async_save``).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

from tierstore.errors import ConfigError

DEFAULT_KEY_ENV = "TIERSTORE_SIGNING_KEY"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16


def _key(name: str, environ: Mapping[str, str]) -> bytes | None:
    value = environ.get(name)
    if not value:
        return None
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"signing: environment variable {name} holds a key shorter than {MIN_KEY_BYTES} bytes;"
            " use a random key of at least 32 bytes (e.g. `openssl rand -hex 32`)"
        )
    return key


class SigningKeys:
    """The key this process signs with and every key it accepts (the first is the signing key).

    Build with :func:`keys_from_env`. Never holds a key in a printable attribute.
    """

    __slots__ = ("_accepted", "_names", "require")

    def __init__(self, names: tuple[str, ...], accepted: tuple[bytes, ...], *, require: bool) -> None:
        self._names = names
        self._accepted = accepted
        self.require = require

    def __repr__(self) -> str:
        return f"SigningKeys(from={', '.join(self._names)}, accepted={len(self._accepted)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (keys_from_env, (self._names[0], self._names[1:], self.require))

    @property
    def key_env(self) -> str:
        """The environment variable the signing key comes from (for messages)."""
        return self._names[0]

    def sign(self, body: bytes) -> str:
        """The signature of ``body``: ``hmac-sha256:<64 hex digits>``."""
        return f"{ALGORITHM}:{hmac.new(self._accepted[0], body, sha256).hexdigest()}"

    def accepts(self, body: bytes, signature: str | None) -> bool:
        """Whether ``signature`` signs ``body`` with one of the accepted keys (constant time)."""
        if not signature or not signature.startswith(f"{ALGORITHM}:"):
            return False
        given = signature.removeprefix(f"{ALGORITHM}:").encode()
        found = False
        for key in self._accepted:
            found |= hmac.compare_digest(given, hmac.new(key, body, sha256).hexdigest().encode())
        return found


@dataclass(frozen=True)
class MarkerTrust:
    """Which commit markers a reader accepts: those of ``namespace`` (``""``: none; None: any) and,
    with ``keys``, only those one of them signed. Built once from the configuration
    (:meth:`~tierstore.config.Config.marker_trust`); ``MarkerTrust()`` checks neither."""

    namespace: str | None = None
    keys: SigningKeys | None = None


def keys_from_env(
    key_env: str,
    verify_key_envs: tuple[str, ...] | list[str] = (),
    require: bool = False,
    environ: Mapping[str, str] | None = None,
) -> SigningKeys | None:
    """The keys named by the configuration, read from the environment now; None: signing is off.

    Raises :class:`ConfigError` naming the variable when ``require`` and ``key_env`` is unset or
    empty, or when a key is shorter than 16 bytes. Keys named by ``verify_key_envs`` are accepted
    for verification only, and only while ``key_env`` is set.
    """
    env = os.environ if environ is None else environ
    signing = _key(key_env, env)
    if signing is None:
        if require:
            raise ConfigError(
                f"signing: require is true but environment variable {key_env} is not set: export"
                " the job's signing key there (keys come from the environment, never the YAML)"
            )
        return None
    older = tuple(k for name in verify_key_envs if (k := _key(name, env)) is not None)
    return SigningKeys((key_env, *verify_key_envs), (signing, *older), require=require)
