"""How a node's promoter last fared, left where ``tierstore status`` can read it without asking it.

The promoter's own ``/healthz`` answers only to whoever can reach its port. So at the end of every pass
(finished or failed) the promoter also writes a small record, ``.tierstore/promoter/node<N>.json``, into
the node-local tiers it looks after (into its first tier when it has none: one more small write per
pass there, never into a slow tier it does not otherwise write each pass). ``tierstore status`` reads it
and judges it with the same bound as the liveness probe (:func:`tierstore.promote.health.stall_bound`):
a record older than that bound is a stuck or stopped promoter.

The record is advisory: nothing in the commit protocol reads it, and a damaged one is reported, not
trusted.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field

from tierstore.errors import IntegrityError
from tierstore.ids import promoter_state_path
from tierstore.records.marker import dump_record, load_record
from tierstore.tiers import Tier

FORMAT = "tierstore.promoter/1"
CLOCK_TOLERANCE = 30.0
"""Seconds a record may be stamped ahead of the reader's clock (hosts' clocks differ a little)."""


@dataclass(frozen=True)
class PromoterState:
    """One promoter's last pass, as it recorded it."""

    node: int
    interval: float
    """Its ``promote.interval`` in seconds."""
    stall_after: float
    """Seconds without a pass after which its liveness probe says it is stuck."""
    passes: int
    """Passes finished since it started."""
    last_error: str | None
    """Why the last pass failed, or None when it finished."""
    unreachable: dict[str, str] = field(default_factory=dict)
    """``{tier: why}`` for the tiers the last pass could not list."""
    unavailable: tuple[str, ...] = ()
    """Tiers that refused writes (full, read-only) at the last promotion into them."""
    backlog: int = 0
    """Promotions still waiting at the end of the last pass."""
    failed: tuple[str, ...] = ()
    """The last pass's failed promotions, one line each (``id source->target: why``)."""
    started_at: float = 0.0
    """When this promoter started (epoch seconds)."""
    at: float = field(default_factory=time.time)
    """When the record was written: the end of the last pass (epoch seconds)."""
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    def to_json(self) -> bytes:
        """Serialize."""
        body = asdict(self)
        body["unavailable"] = list(self.unavailable)
        body["failed"] = list(self.failed)
        return dump_record(FORMAT, body, ())

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> PromoterState:
        """Parse; :class:`IntegrityError` naming ``where`` if malformed."""
        try:
            body = load_record(FORMAT, data)
            error = body.get("last_error")
            state = cls(
                node=int(body["node"]),
                interval=float(body["interval"]),
                stall_after=float(body["stall_after"]),
                passes=int(body["passes"]),
                last_error=None if error is None else str(error),
                unreachable={str(k): str(v) for k, v in dict(body["unreachable"]).items()},
                unavailable=tuple(str(t) for t in body["unavailable"]),
                backlog=int(body["backlog"]),
                failed=tuple(str(line) for line in body.get("failed", ())),
                started_at=float(body["started_at"]),
                at=float(body["at"]),
                host=str(body["host"]),
                pid=int(body["pid"]),
            )
            times = (state.interval, state.stall_after, state.started_at, state.at)
            if not all(math.isfinite(value) for value in times):
                raise ValueError(f"a time that is not a finite number: {times}")
            return state
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"{where}: malformed promoter state ({exc})") from None

    def health(self, now: float | None = None) -> tuple[bool, str]:
        """``(ok, why)``: ok while the last pass is younger than :attr:`stall_after` and finished.
        A record stamped in the future (by more than :data:`CLOCK_TOLERANCE`) says nothing about
        now: the promoter's clock ran ahead, and it may have stopped since."""
        age = (time.time() if now is None else now) - self.at
        if age < -CLOCK_TOLERANCE:
            return False, (
                f"cannot tell: its last record is stamped {-age:.0f} s in the future (its clock"
                " is ahead of this host's)"
            )
        if age > self.stall_after:
            return (False, f"stuck or stopped: last pass {age:.0f} s ago (bound {self.stall_after:.0f} s)")
        if self.last_error is not None:
            return False, f"failing: last pass {age:.0f} s ago failed: {self.last_error}"
        return True, f"ok: last pass {age:.0f} s ago, {self.passes} passes"

    def troubles(self) -> list[str]:
        """What the last pass could not do, one line each: tiers it could not list, tiers that
        refused writes, promotions that failed."""
        found = [f"could not list tier {tier}: {why}" for tier, why in sorted(self.unreachable.items())]
        found += [
            f"tier {tier} refuses writes (full or read-only): promotions route around it"
            for tier in self.unavailable
        ]
        found += [f"promotion failed: {line}" for line in self.failed]
        return found


def write_state(tier: Tier, state: PromoterState) -> None:
    """Leave ``state`` in ``tier`` (replacing the node's previous record)."""
    tier.publish(promoter_state_path(state.node), state.to_json(), create_only=False)


def read_state(tier: Tier, node: int) -> PromoterState | None:
    """The state record of ``node``'s promoter in ``tier``, or None when there is none."""
    path = promoter_state_path(node)
    try:
        data = tier.read_bytes(path)
    except FileNotFoundError:
        return None
    return PromoterState.from_json(data, where=f"tier {tier.name}: {path}")
