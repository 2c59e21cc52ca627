"""The YAML configuration: schema, validation and :func:`load_config`.

A configuration names the tiers (fastest first: saves go to the first) and the policies. Loading it
validates everything a user can get wrong and raises :class:`~tierstore.errors.ConfigError` as
``FILE: KEY: what was expected``. The result is immutable (frozen pydantic models) and picklable, so a
writer carrying it can travel to DCP's background checkpoint process.

Strings may use ``${VAR}`` or ``${VAR:-default}`` (expanded from the environment before validation;
``$${`` is a literal ``${``). Relative paths are relative to the YAML file's directory. A node-local
tier's ``path`` may contain ``{node}``, the node index (see :mod:`tierstore.topology`). Credentials never
come from the YAML: S3 tiers use the standard AWS environment variables, profile or instance role.

This module holds the fields common to every configuration. Each ``tiers`` entry parts at load: its
storage keys are validated by the config model its ``type`` registered (:mod:`tierstore.tiers.registry`),
which also carries that type's load-time checks; its retention and promotion keys (``keep``,
``keep_every``, ``pin``, ``every``) by :class:`~tierstore.policy_config.TierPolicy`, read through
:meth:`Config.policy`. A dump (``model_dump``) writes each entry whole again, as the YAML has it.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializationInfo,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from tierstore._platform.bounded import Prober
from tierstore.errors import ConfigError, TierUnavailableError
from tierstore.ids import ID_PATTERN
from tierstore.placement import MirrorConfig
from tierstore.policy_config import TierPolicy, entry_order, merge_entry, split_entry
from tierstore.signing import DEFAULT_KEY_ENV, MarkerTrust, SigningKeys, keys_from_env
from tierstore.tiers import RetryHook, Tier, TierConfig, is_host_memory, make_tier, tier_types
from tierstore.tiers.registry import config_model
from tierstore.topology import current_node
from tierstore.units import Duration, StrictModel

_ENV = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class PromoteConfig(StrictModel):
    """How the promoter sidecar moves committed checkpoints down the tiers."""

    every: int = Field(1, ge=1, description="Every k-th committed checkpoint reaches the last tier.")
    interval: Duration = Field(10.0, description="Polling interval for new markers.")
    full_scan: Duration = Field(
        300.0,
        description="A pass lists a tier whose change stamp is unchanged again once its last listing"
        " is this old (changes made behind tierstore's back are seen within it); 0: every pass.",
    )
    keeper_lease: Duration = Field(
        30.0,
        description="The lease of a job-wide tier's keeper: renewed 3x as often; every other node reads"
        " it about once per lease (1,250 nodes: 31-42 GET/s at 30s); a dead keeper is replaced within 3x.",
    )
    grace_period: Duration = Field(30.0, description="On SIGTERM, time allowed to finish a file.")
    stale_after: Duration = Field(
        3600.0, description="Age after which uncommitted leftovers and multipart uploads are removed."
    )
    workers: int = Field(4, ge=1, le=64, description="Files copied in parallel.")
    activity_ttl: Duration = Field(
        60.0,
        description="A save, promotion or restore at work refreshes its activity record 4x as often;"
        " cleanup treats a record not refreshed for this long as left by a holder that is gone.",
    )

    @field_validator("keeper_lease")
    @classmethod
    def _lease_is_positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"expected more than 0s, got {value}")
        return value

    @field_validator("activity_ttl")
    @classmethod
    def _ttl_allows_a_refresh(cls, value: float) -> float:
        if value < 1.0:
            raise ValueError(f"expected at least 1s, got {value}")
        return value


class StagingConfig(StrictModel):
    """How ``dcp.async_save`` stages the state (see docs/usage.md, "Overlapped saves")."""

    overlap: bool = Field(
        False,
        description="Copy the state on a background thread: async_save returns an AsyncSaveResponse"
        " at once, and the trainer waits on its staging_completion before modifying the state.",
    )


class MetricsConfig(StrictModel):
    """Trainer-side metrics: each rank's save stall, times and bytes in a file per rank, served by
    the node's promoter on its ``/metrics`` (see :mod:`tierstore._platform.save_metrics`)."""

    directory: str | None = Field(
        None,
        description="Directory each rank writes its save metrics to (rank-NNNNN.prom), on the"
        " node's local disk or tmpfs; may contain {node}; none: trainer-side metrics are off.",
    )
    stale_after: Duration = Field(
        86400.0, description="The promoter leaves out files not rewritten for this long (0: never)."
    )

    @field_validator("directory")
    @classmethod
    def _a_path_with_node_only(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("expected a directory, got an empty string")
        if "{" in value.replace("{node}", "") or "}" in value.replace("{node}", ""):
            raise ValueError(f"expected a path whose only placeholder is {{node}}, got {value!r}")
        return value

    def directory_for(self, node: int) -> str | None:
        """The directory on node ``node`` (``{node}`` replaced); None when metrics are off."""
        return None if self.directory is None else self.directory.replace("{node}", str(node))


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SigningConfig(StrictModel):
    """Optional signing of commit markers (see :mod:`tierstore.signing`). The YAML names the
    environment variables that hold the keys; a key itself never appears in the YAML."""

    key_env: str = Field(
        DEFAULT_KEY_ENV,
        description="Environment variable holding the job's signing key; signing is on when it is"
        " set (markers are signed, and unsigned or mis-signed ones are refused).",
    )
    verify_key_envs: tuple[str, ...] = Field(
        (), description="Environment variables of older keys still accepted (key rotation)."
    )
    require: bool = Field(False, description="Refuse to start when the key_env variable is not set.")

    @field_validator("key_env")
    @classmethod
    def _an_env_name(cls, value: str) -> str:
        if not _ENV_NAME.fullmatch(value):
            raise ValueError(f"expected an environment variable name, got {value!r}")
        return value

    @field_validator("verify_key_envs")
    @classmethod
    def _env_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            cls._an_env_name(name)
        return value

    def keys(self) -> SigningKeys | None:
        """The keys, read from the environment now; None when signing is off. ConfigError naming
        the variable when ``require`` and it is unset (see :func:`keys_from_env`)."""
        return keys_from_env(self.key_env, self.verify_key_envs, self.require)


class Config(StrictModel):
    """A validated, immutable tierstore configuration (see :func:`load_config`)."""

    namespace: str | None = Field(None, description="Sub-folder/prefix inside every tier.")
    # SerializeAsAny: model_dump() writes each tier with its own type's fields (a YAML round trip).
    tiers: tuple[SerializeAsAny[TierConfig], ...] = Field(
        min_length=1, description="Fastest first; each entry's `type` names a registered tier type."
    )
    promote: PromoteConfig = PromoteConfig()
    staging: StagingConfig = StagingConfig()
    metrics: MetricsConfig = MetricsConfig()
    signing: SigningConfig = SigningConfig()
    verify_on_load: bool = Field(False, description="Check CRC32C of every file read on load.")
    check_finite: bool = Field(False, description="Refuse to commit NaN/Inf floating tensors.")
    probe_timeout: Duration = Field(
        10.0,
        description="How long a save's start-up look, a restore or the promoter waits for a tier"
        " that does not answer before treating it as unreachable (tiers stand alone).",
    )
    origin: str = Field("<memory>", description="The file this configuration came from.")
    _policies: dict[str, TierPolicy] = PrivateAttr(default_factory=dict)
    """Each tier's retention and promotion fields, by tier name (see :meth:`policy`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _split_policies(
        cls, data: Any, handler: ModelWrapValidatorHandler[Config], info: ValidationInfo
    ) -> Config:
        """Each raw ``tiers`` mapping parts into its storage keys (the tier type's model) and its
        :class:`TierPolicy`; entries validated already by ``config_from_dict`` bring theirs in the
        validation context, by name."""
        if isinstance(data, Config):
            return handler(data)
        policies: dict[str, TierPolicy] = dict((info.context or {}).get(_POLICIES_CONTEXT, {}))
        problems: list[InitErrorDetails] = []
        if isinstance(data, dict) and isinstance(data.get("tiers"), list | tuple):
            tiers = []
            for index, item in enumerate(data["tiers"]):
                if not isinstance(item, dict):
                    tiers.append(item)
                    continue
                storage, raw_policy = split_entry(item)
                tiers.append(storage)
                try:
                    policies[str(item.get("name"))] = TierPolicy.model_validate(raw_policy)
                except ValidationError as exc:
                    problems += _relocated(exc, ("tiers", index))
            data = {**data, "tiers": tiers}
        try:
            config = handler(data)
        except ValidationError as exc:
            if not problems:
                raise
            problems = [*_relocated(exc, ()), *problems]
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        config._policies = {t.name: policies.get(t.name, TierPolicy()) for t in config.tiers}
        return config

    @model_serializer(mode="wrap")
    def _tiers_with_their_policies(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        """A dump writes each ``tiers`` entry whole, storage and policy keys as in the YAML, so
        that it loads back as it was."""
        data: dict[str, Any] = handler(self)
        dumped = data.get("tiers")
        if not isinstance(dumped, list | tuple):
            return data
        options: dict[str, Any] = {
            "mode": info.mode,
            "exclude_none": info.exclude_none,
            "exclude_defaults": info.exclude_defaults,
            "exclude_unset": info.exclude_unset,
        }
        data["tiers"] = type(dumped)(
            merge_entry(entry, self._policies[entry["name"]].model_dump(**options))
            if isinstance(entry, dict) and entry.get("name") in self._policies
            else entry
            for entry in dumped
        )
        return data

    @field_validator("namespace")
    @classmethod
    def _namespace_is_relative(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = value.strip("/").split("/")
        if not all(ID_PATTERN.fullmatch(p) and p not in (".", "..") for p in parts):
            raise ValueError(f"expected names of [A-Za-z0-9._-] separated by '/', got {value!r}")
        return "/".join(parts)

    @field_validator("tiers", mode="before")
    @classmethod
    def _dispatch_on_type(cls, tiers: Any) -> Any:
        """Raw mappings become their registered type's model (``config_from_dict`` does it first,
        with per-key error locations; this covers ``Config(tiers=[{...}])``)."""
        if not isinstance(tiers, list | tuple):
            return tiers
        return tuple(_tier_model(item) if isinstance(item, dict) else item for item in tiers)

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: tuple[TierConfig, ...]) -> tuple[TierConfig, ...]:
        seen: set[str] = set()
        for tier in tiers:
            if tier.name in seen:
                raise ValueError(f"duplicate tier name {tier.name!r}")
            seen.add(tier.name)
        return tiers

    @field_validator("tiers")
    @classmethod
    def _one_mirror(cls, tiers: tuple[TierConfig, ...]) -> tuple[TierConfig, ...]:
        mirrored = [t.name for t in tiers if getattr(t, "mirror", None) is not None]
        if len(mirrored) > 1:
            raise ValueError(f"mirror is set on tiers {mirrored}: expected at most one mirrored memory tier")
        return tiers

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``; :class:`ConfigError` listing the known names otherwise."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        known = ", ".join(t.name for t in self.tiers)
        raise ConfigError(f"{self.origin}: tiers: no tier named {name!r} (known: {known})")

    def policy(self, name: str) -> TierPolicy:
        """The retention and promotion fields of the tier called ``name`` (``keep``,
        ``keep_every``, ``pin``, ``every``); :class:`ConfigError` listing the known names if there
        is no such tier."""
        self.tier(name)
        return self._policies.get(name, TierPolicy())

    @property
    def mirrored(self) -> str | None:
        """The tier mirrored into partner nodes' host memory (a memory tier's ``mirror``; at most
        one), or None."""
        return next((t.name for t in self.tiers if getattr(t, "mirror", None) is not None), None)

    def mirror_of(self, name: str) -> MirrorConfig | None:
        """How the tier called ``name`` is mirrored (its ``mirror``); None when it is not."""
        mirror: MirrorConfig | None = getattr(self.tier(name), "mirror", None)
        return mirror

    def marker_trust(self) -> MarkerTrust:
        """Which markers this job reads: its namespace's, signed by its keys when signing is on (read
        from the environment now: ConfigError as :meth:`SigningConfig.keys`)."""
        return MarkerTrust(self.namespace or "", self.signing.keys())

    def make_tier(self, name: str, *, node: int) -> Tier:
        """The tier called ``name``, as seen from ``node``."""
        return make_tier(self.tier(name), namespace=self.namespace, node=node)

    def make_tiers(self, *, node: int, on_retry: RetryHook | None = None) -> list[Tier]:
        """Every configured tier, fastest first, as seen from ``node`` (``on_retry``: told of each
        transient error a tier retries)."""
        return [make_tier(t, namespace=self.namespace, node=node, on_retry=on_retry) for t in self.tiers]


_POLICIES_CONTEXT = "tier_policies"
"""The validation context's key for the policies ``config_from_dict`` validated, by tier name."""


def _relocated(exc: ValidationError, prefix: tuple[int | str, ...]) -> list[InitErrorDetails]:
    """``exc``'s errors, their locations under ``prefix`` (to raise again as one error)."""
    return [
        InitErrorDetails(type=e["type"], loc=(*prefix, *e["loc"]), input=e["input"], ctx=e["ctx"])
        if "ctx" in e
        else InitErrorDetails(type=e["type"], loc=(*prefix, *e["loc"]), input=e["input"])
        for e in exc.errors()
    ]


def _unknown_type(tag: object) -> str:
    if tag is None:
        return f"missing required key 'type' (one of {', '.join(tier_types())})"
    return f"unknown tier type {tag!r}; expected one of {', '.join(tier_types())}"


def _tier_model(item: dict[str, Any]) -> TierConfig:
    model = config_model(str(item.get("type")))
    if model is None:
        raise ValueError(_unknown_type(item.get("type")))
    return model.model_validate(item)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate mapping keys instead of keeping the last."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


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
        else:
            text = _join(text, part)
    return text or "top level"


def _describe(error: Mapping[str, Any]) -> str:
    kind, loc = error["type"], error["loc"]
    if kind == "extra_forbidden":
        return f"unknown key {loc[-1]!r}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    got = error.get("input")
    ctx = error.get("ctx") or {}
    expected = {
        "int_parsing": "an integer",
        "int_type": "an integer",
        "int_from_float": "an integer",
        "float_parsing": "a number",
        "float_type": "a number",
        "bool_parsing": "true or false",
        "bool_type": "true or false",
        "string_type": "a string",
        "list_type": "a list",
        "tuple_type": "a list",
        "model_type": "a mapping",
        "dict_type": "a mapping",
        "model_attributes_type": "a mapping",
        "greater_than_equal": f"a value >= {ctx.get('ge')}",
        "less_than_equal": f"a value <= {ctx.get('le')}",
        "too_short": f"at least {ctx.get('min_length')} item(s)",
    }.get(kind)
    if expected:
        return f"expected {expected}, got {got!r}"
    return str(error["msg"]).removeprefix("Value error, ")


def config_from_dict(
    data: object, *, source: str = "<dict>", check_paths: bool = True, node: int | None = None
) -> Config:
    """Validate an already-parsed configuration (as :func:`load_config` does after reading YAML)."""
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "an empty document"
        raise ConfigError(f"{source}: top level: expected a mapping with a 'tiers' list, got {kind}")
    expanded = _expand_env(data, "", source)
    expanded["origin"] = source
    base = Path(source).parent if source not in ("<dict>", "<memory>") else Path.cwd()
    lines: list[str] = []
    raw_tiers = expanded.get("tiers")
    policies: dict[str, TierPolicy] = {}
    if isinstance(raw_tiers, list):
        tiers: list[Any] = []
        for index, raw in enumerate(raw_tiers):
            validated, problems = _validate_tier(raw, index, base, source)
            lines += problems
            if validated is not None:
                tiers.append(validated[0])
                policies[validated[0].name] = validated[1]
        expanded["tiers"] = tiers if not lines else tiers or None
    metrics = expanded.get("metrics")
    directory = metrics.get("directory") if isinstance(metrics, dict) else None
    if isinstance(metrics, dict) and isinstance(directory, str) and directory.strip():
        expanded["metrics"] = {**metrics, "directory": str(base / directory)}
    try:
        config = Config.model_validate(expanded, context={_POLICIES_CONTEXT: policies})
    except ValidationError as exc:
        errors = exc.errors()
        if lines:  # the tiers' own errors were reported; the list is then short or missing
            errors = [e for e in errors if e["loc"][:1] != ("tiers",)]
        lines += [f"{source}: {_format_loc(e['loc'])}: {_describe(e)}" for e in errors]
    if lines:
        raise ConfigError("\n".join(lines)) from None
    try:
        config.signing.keys()  # require: true without the key fails here, at load
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if check_paths:
        this_node = current_node(node)
        tiers = config.make_tiers(node=this_node)
        answered = _check_tiers(config, tiers, source, this_node)
        roots = [(t, _root_key(t.root, resolve=t.name in answered)) for t in tiers]
        _check_separate_roots(roots, source)
        _check_metrics_directory(config, roots, source, this_node)
    return config


def _check_tiers(config: Config, tiers: list[Tier], source: str, node: int) -> set[str]:
    """Each tier's own check (a POSIX path created and proved writable), each within
    ``probe_timeout``: a tier on a hung mount is left to the process's health view (one WARNING,
    and every later question of the process skips it) instead of holding the process at start-up,
    and the other tiers go on without it. The names of the tiers that answered."""
    prober, answered = Prober(config.probe_timeout), set()
    for index, (settings, tier) in enumerate(zip(config.tiers, tiers, strict=True)):
        check = functools.partial(settings.check_usable, node=node, namespace=config.namespace)
        try:
            problem = prober.ask(
                tier, check, what="check its path", direct=not tier.local or is_host_memory(tier)
            )
        except TierUnavailableError:
            continue
        if problem:
            key, expected = problem
            raise ConfigError(f"{source}: tiers[{index}].{key}: {expected}")
        answered.add(tier.name)
    return answered


def _root_key(root: str, *, resolve: bool = True) -> str:
    """A tier root as a comparable location: URLs as written, paths resolved (symlinks, ``..``),
    or, for a tier that did not answer (resolving would hang too), made absolute as written."""
    if "://" in root:
        return root.rstrip("/")
    return os.path.realpath(root) if resolve else os.path.abspath(root)


def _check_separate_roots(roots: list[tuple[Tier, str]], source: str) -> None:
    """Two tiers on one directory (or one inside the other's) would see each other's checkpoints as
    their own: retention of one deletes the other's copies. Refused, naming both."""
    for later, (tier, root) in enumerate(roots):
        for other, other_root in roots[:later]:
            inside = (root + "/").startswith(other_root + "/") or ((other_root + "/").startswith(root + "/"))
            if inside:
                key = "url" if "://" in root else "path"
                raise ConfigError(
                    f"{source}: tiers[{later}].{key}: tier {tier.name!r} ({root}) and tier"
                    f" {other.name!r} ({other_root}) share a location: each tier needs a"
                    " directory or prefix of its own, neither inside the other"
                )


def _check_metrics_directory(config: Config, roots: list[tuple[Tier, str]], source: str, node: int) -> None:
    """The metrics directory is created, must be writable, and must stay out of every tier's
    directory: a tier takes what is in its directory for its own (cleanup removes leftovers)."""
    wanted = config.metrics.directory_for(node)
    if wanted is None:
        return
    where = f"{source}: metrics.directory"
    directory = _root_key(wanted)
    for tier, root in roots:
        if "://" not in root and (
            (directory + "/").startswith(root + "/") or (root + "/").startswith(directory + "/")
        ):
            raise ConfigError(
                f"{where}: expected a directory outside every tier's, got {wanted!r}, which"
                f" shares a location with tier {tier.name!r} ({root})"
            )
    try:
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise ConfigError(
            f"{where}: expected a writable directory, got {wanted!r} ({exc.strerror or exc})"
        ) from None


def _validate_tier(
    raw: object, index: int, base: Path, source: str
) -> tuple[tuple[TierConfig, TierPolicy] | None, list[str]]:
    """One ``tiers[i]`` entry as its registered type's model and its policy, or the
    ``FILE: KEY: ...`` lines (in the entry's documented key order, unknown keys last)."""
    where = f"{source}: tiers[{index}]"
    if not isinstance(raw, dict):
        return None, [f"{where}: expected a mapping, got {raw!r}"]
    model = config_model(str(raw.get("type")))
    if model is None:
        return None, [f"{where}: {_unknown_type(raw.get('type'))}"]
    storage, policy = split_entry(raw)
    errors: list[Any] = []
    try:
        tier = model.model_validate(model.resolve_relative(storage, base))
    except ValidationError as exc:
        errors += exc.errors()
    try:
        rules = TierPolicy.model_validate(policy)
    except ValidationError as exc:
        errors += exc.errors()
    if not errors:
        return (tier, rules), []
    order = entry_order(model.model_fields)
    errors.sort(key=lambda e: order.get(str(e["loc"][0]), len(order)) if e["loc"] else len(order))
    return None, [f"{source}: {_format_loc(('tiers', index, *e['loc']))}: {_describe(e)}" for e in errors]


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
        hint = _placeholder_hint(text, mark.line if mark else None)
        raise ConfigError(f"{source}: {where}: malformed YAML: {problem}{hint}") from None
    return config_from_dict(data, source=str(Path(source).resolve()), check_paths=check_paths)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_PLACEHOLDER_VALUE = re.compile(r"([\w-]+):\s*([^\s,{}]*\{\w+\}[^\s,}]*)")


def _placeholder_hint(text: str, line: int | None) -> str:
    """A hint for a YAML error at ``line`` (0-based) whose line, or the one before, holds an
    unquoted placeholder such as ``{node}``: in flow style (``{name: ram, path: /x/{node}}``) a brace
    opens a mapping, and the error (``expected ',' or '}'``) does not say so."""
    if line is None:
        return ""
    lines = text.splitlines()
    for number in (line, line - 1):
        if not 0 <= number < len(lines):
            continue
        unquoted = _QUOTED.sub("", lines[number])
        found = _PLACEHOLDER_VALUE.search(unquoted)
        if found:
            key, value = found.groups()
            return (
                f" (line {number + 1}: an unquoted {{...}} opens a YAML mapping; quote the value:"
                f" {key}: '{value}')"
            )
    return ""


def as_config(config: Config | str | os.PathLike[str]) -> Config:
    """Accept a loaded :class:`Config` or the path of a YAML file."""
    if isinstance(config, Config):
        return config
    if isinstance(config, str | os.PathLike):
        return load_config(config)
    raise ConfigError(f"expected a Config or the path of a YAML file, got {type(config).__name__}")
