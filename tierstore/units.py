"""Quantities a user writes in YAML (``64MiB``, ``10s``) and the strict model every config part uses."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DURATIONS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``64MiB``, ``1GB``, ``512kib``; ValueError otherwise."""
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
"""A non-negative number of seconds, written as a number or ``10s``/``5m``/``1h``."""
Size = Annotated[int, BeforeValidator(parse_size)]
"""A number of bytes, written as an integer or ``64MiB``/``1GB``."""


class StrictModel(BaseModel):
    """Immutable, unknown keys refused: every part of the configuration is one of these."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


def human_bytes(count: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """``93`` -> ``1m33s``."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
