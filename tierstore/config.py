"""The YAML configuration: schema, validation and :func:`load_config`.

A configuration names the tiers (fastest first: saves go to the first) and the policies. Loading it
validates everything a user can get wrong and raises :class:`~tierstore.errors.ConfigError` as
``FILE: KEY: what was expected``. The result is immutable (frozen pydantic models) and picklable, so a
writer carrying it can travel to DCP's background checkpoint process.

Strings may use ``${VAR}`` or ``${VAR:-default}`` (expanded from the environment before validation;
``$${`` is a literal ``${``). Relative paths are relative to the YAML file's directory. A node-local
tier's ``path`` may contain ``{node}``, the node index (see :mod:`tierstore.topology`). Credentials never
come from the YAML: S3 tiers use the standard AWS environment variables, profile or instance role.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from tierstore.errors import ConfigError
from tierstore.ids import ID_PATTERN, validate_checkpoint_id

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_DURATIONS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_ENV = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_TIER_NAME = re.compile(r"[A-Za-z0-9_-]+")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``64MiB``, ``1GB``, ``512kib``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and (m := _QUANTITY.fullmatch(value)):
        unit = m.group(2).lower()
        if unit in _UNITS:
            return int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(f"expected a size such as 64MiB or 1GB, got {value!r}")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``250ms``, ``10s``, ``5m``, ``1h``, ``7d``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 10s, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and (m := _QUANTITY.fullmatch(value)):
        unit = m.group(2).lower() or "s"
        if unit in _DURATIONS:
            return float(m.group(1)) * _DURATIONS[unit]
    raise ValueError(f"expected a duration such as 10s, 5m or 1h, got {value!r}")


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class _TierBase(_Strict):
    name: str = Field(description="Unique tier name, used by `tier=` and in the CLI.")
    keep: int | None = Field(None, ge=1, description="Retention: keep the N newest committed.")
    keep_every: int | None = Field(None, ge=1, description="Retention: also keep steps % M == 0.")
    pin: tuple[str, ...] = Field((), description="Retention: ids never deleted from this tier.")
    every: int | None = Field(
        None, ge=1, description="Promotion: every k-th committed checkpoint reaches this tier."
    )

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        if not _TIER_NAME.fullmatch(value):
            raise ValueError(f"expected letters, digits, '_' or '-', got {value!r}")
        return value

    @field_validator("pin")
    @classmethod
    def _pins_are_ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            validate_checkpoint_id(item)
        return value


class _PosixTierBase(_TierBase):
    path: str = Field(description="Directory of the tier (absolute, or relative to the YAML file).")

    @property
    def node_local(self) -> bool:
        """True when each node has its own copy of this tier (its path may contain ``{node}``)."""
        return self.type in ("memory", "local")  # type: ignore[attr-defined]

    def path_for(self, node: int) -> str:
        """The tier directory on node ``node``."""
        return self.path.replace("{node}", str(node))


class MemoryTierConfig(_PosixTierBase):
    """Host memory: a tmpfs directory on each node (default ``/dev/shm/tierstore``)."""

    type: Literal["memory"]
    path: str = "/dev/shm/tierstore"


class LocalTierConfig(_PosixTierBase):
    """Node-local disk (NVMe); each node has its own."""

    type: Literal["local"]


class SharedTierConfig(_PosixTierBase):
    """A POSIX path every node sees (Lustre, GPFS, NFS)."""

    type: Literal["shared"]


class S3TierConfig(_TierBase):
    """An S3 bucket/prefix (AWS or any S3-compatible endpoint), through fsspec/s3fs."""

    type: Literal["s3"]
    url: str = Field(description="s3://bucket[/prefix]")
    endpoint_url: str | None = Field(None, description="For S3-compatible stores.")
    region: str | None = None
    part_size: Annotated[int, BeforeValidator(parse_size), Field(ge=5 * 2**20, le=5 * 2**30)] = (
        Field(64 * 2**20, description="Multipart part size (S3 allows 5 MiB to 5 GiB).")
    )
    concurrency: int = Field(8, ge=1, le=256, description="Parts in flight per file.")
    max_attempts: int = Field(8, ge=1, le=100, description="Attempts per idempotent request.")
    max_retry_time: Duration = Field(120.0, description="Bound on one request's retries.")
    checksum: Literal["crc32", "none"] = Field(
        "crc32",
        description="Send a CRC32 with every part/object (S3 verifies it); none for stores that reject it.",
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

    @property
    def node_local(self) -> bool:
        """S3 is global: never node-local."""
        return False


TierConfig = Annotated[
    Union[MemoryTierConfig, LocalTierConfig, SharedTierConfig, S3TierConfig],  # noqa: UP007
    Field(discriminator="type"),
]
TIER_TYPES = ("memory", "local", "shared", "s3")


class PromoteConfig(_Strict):
    """How the promoter sidecar moves committed checkpoints down the tiers."""

    every: int = Field(
        1, ge=1, description="Every k-th committed checkpoint reaches the last tier."
    )
    interval: Duration = Field(10.0, description="Polling interval for new markers.")
    grace_period: Duration = Field(30.0, description="On SIGTERM, time allowed to finish a file.")
    stale_after: Duration = Field(
        3600.0,
        description="Age after which uncommitted leftovers and multipart uploads are removed.",
    )
    workers: int = Field(4, ge=1, le=64, description="Files copied in parallel.")


class Config(_Strict):
    """A validated, immutable tierstore configuration (see :func:`load_config`)."""

    namespace: str | None = Field(None, description="Sub-folder/prefix inside every tier.")
    tiers: tuple[TierConfig, ...] = Field(min_length=1)
    promote: PromoteConfig = PromoteConfig()
    verify_on_load: bool = Field(False, description="Check CRC32C of every file read on load.")
    check_finite: bool = Field(False, description="Refuse to commit NaN/Inf floating tensors.")
    source: str = Field("<memory>", description="Where this configuration came from.")

    @field_validator("namespace")
    @classmethod
    def _namespace_is_relative(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = value.strip("/").split("/")
        if not all(ID_PATTERN.fullmatch(p) and p not in (".", "..") for p in parts):
            raise ValueError(f"expected names of [A-Za-z0-9._-] separated by '/', got {value!r}")
        return "/".join(parts)

    @field_validator("tiers")
    @classmethod
    def _unique_names_and_placeholders(
        cls, tiers: tuple[TierConfig, ...]
    ) -> tuple[TierConfig, ...]:
        seen: set[str] = set()
        for tier in tiers:
            if tier.name in seen:
                raise ValueError(f"duplicate tier name {tier.name!r}")
            seen.add(tier.name)
            if isinstance(tier, SharedTierConfig) and "{node}" in tier.path:
                raise ValueError(
                    f"tier {tier.name!r}: '{{node}}' is only for node-local tiers (memory, local)"
                )
        return tiers

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``; :class:`ConfigError` listing the known names otherwise."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        known = ", ".join(t.name for t in self.tiers)
        raise ConfigError(f"{self.source}: tiers: no tier named {name!r} (known: {known})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate mapping keys instead of keeping the last."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,
)


def _expand_env(value: Any, loc: str, source: str) -> Any:
    """Expand ``${VAR}`` in every string of a parsed YAML tree."""
    if isinstance(value, dict):
        return {k: _expand_env(v, _join(loc, k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{loc}[{i}]", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{source}: {loc}: environment variable {name!r} is not set")

    return _ENV.sub(substitute, value)


def _join(loc: str, key: object) -> str:
    return f"{loc}.{key}" if loc else str(key)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in TIER_TYPES and text.startswith("tiers[") and text.endswith("]"):
            continue  # pydantic's discriminator tag, not a key the user wrote
        else:
            text = _join(text, part)
    return text or "top level"


def _describe(error: Mapping[str, Any]) -> str:
    kind, loc = error["type"], error["loc"]
    if kind == "extra_forbidden":
        return f"unknown key {loc[-1]!r}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    if kind == "union_tag_invalid":
        tag = error.get("input", {}).get("type") if isinstance(error.get("input"), dict) else None
        return f"unknown tier type {tag!r}; expected one of {', '.join(TIER_TYPES)}"
    if kind == "union_tag_not_found":
        return f"missing required key 'type' (one of {', '.join(TIER_TYPES)})"
    got = error.get("input")
    ctx = error.get("ctx") or {}
    expected = {
        "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
        "float_parsing": "a number", "float_type": "a number",
        "bool_parsing": "true or false", "bool_type": "true or false",
        "string_type": "a string", "list_type": "a list", "tuple_type": "a list",
        "model_type": "a mapping", "dict_type": "a mapping", "model_attributes_type": "a mapping",
        "greater_than_equal": f"a value >= {ctx.get('ge')}",
        "less_than_equal": f"a value <= {ctx.get('le')}",
        "too_short": f"at least {ctx.get('min_length')} item(s)",
    }.get(kind)  # fmt: skip
    if expected:
        return f"expected {expected}, got {got!r}"
    return str(error["msg"]).removeprefix("Value error, ")


def _check_writable(directory: Path) -> str | None:
    """Create ``directory`` if needed and prove it writable; return why not, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tierstore-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"expected a writable directory, got {str(directory)!r} ({exc.strerror or exc})"
    return None


def config_from_dict(
    data: object, *, source: str = "<dict>", check_paths: bool = True, node: int | None = None
) -> Config:
    """Validate an already-parsed configuration (as :func:`load_config` does after reading YAML)."""
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "an empty document"
        raise ConfigError(
            f"{source}: top level: expected a mapping with a 'tiers' list, got {kind}"
        )
    expanded = _expand_env(data, "", source)
    expanded["source"] = source
    base = Path(source).parent if source not in ("<dict>", "<memory>") else Path.cwd()
    for tier in expanded.get("tiers") or []:
        if isinstance(tier, dict) and isinstance(tier.get("path"), str):
            tier["path"] = str(base / tier["path"])
    try:
        config = Config.model_validate(expanded)
    except ValidationError as exc:
        errors = exc.errors()
        deeper = {e["loc"][:1] for e in errors if len(e["loc"]) > 1}
        # An invalid item also makes pydantic report its list as too short: keep the real cause.
        errors = [e for e in errors if not (e["type"] == "too_short" and e["loc"] in deeper)]
        lines = [f"{source}: {_format_loc(e['loc'])}: {_describe(e)}" for e in errors]
        raise ConfigError("\n".join(lines)) from None
    if check_paths:
        from tierstore.topology import current_node

        this_node = current_node() if node is None else node
        for index, tier in enumerate(config.tiers):
            if isinstance(tier, _PosixTierBase):
                root = Path(tier.path_for(this_node))
                if config.namespace:
                    root = root / config.namespace
                if problem := _check_writable(root):
                    raise ConfigError(f"{source}: tiers[{index}].path: {problem}")
    return config


def load_config(path: str | os.PathLike[str], *, check_paths: bool = True) -> Config:
    """Read, expand and validate the YAML file at ``path``.

    Raises :class:`ConfigError` (``FILE: KEY: what was expected``) for an unreadable file, malformed
    YAML, duplicate or unknown keys, wrong types, unknown tier types, duplicate tier names, a missing
    ``path``/``url``, an unset ``${VAR}`` or (with ``check_paths``) a POSIX tier path that cannot be
    created or written. POSIX tier directories are created on this node as a side effect.
    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{source}: cannot read configuration file ({reason})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: {where}: malformed YAML: {problem}") from None
    return config_from_dict(data, source=str(Path(source).resolve()), check_paths=check_paths)


def as_config(config: Config | str | os.PathLike[str]) -> Config:
    """Accept a loaded :class:`Config` or the path of a YAML file."""
    if isinstance(config, Config):
        return config
    if isinstance(config, str | os.PathLike):
        return load_config(config)
    raise ConfigError(f"expected a Config or the path of a YAML file, got {type(config).__name__}")
