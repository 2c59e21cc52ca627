"""Where each node's peer mirror lives: a pure function of the recorded topology.

Whole nodes are paired, never ranks: (0,1), (2,3), ... in node order; with an odd count the last three
form a ring (each of them holds exactly one foreign copy); a lone node has no partner. ``stride`` puts
partners ``stride`` apart in node order (nodes ``0..stride-1`` in one rack pair with the next rack's),
so that a partner sits in another failure domain. A partner on the same host as its owner is refused:
a mirror that dies with the node it protects is no mirror. The result depends only on its inputs, so
a restore recomputes it from the topology recorded in the commit marker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import Field

from tierstore.units import Duration, StrictModel


class MirrorConfig(StrictModel):
    """A memory tier's ``mirror``: ``true``, or a mapping of these fields (see docs/mirror.md)."""

    stride: int = Field(
        1, ge=1, description="Partners sit this many nodes apart in node order (failure domains)."
    )
    timeout: Duration = Field(
        120.0,
        description="A mirror exchange (or a peer restore transfer) that waits this long on a peer"
        " fails: reduced redundancy, never a hung trainer.",
    )

    @classmethod
    def from_yaml(cls, value: object) -> object:
        """``true`` -> defaults, ``false``/absent -> no mirror, a mapping -> its fields."""
        if value is True:
            return cls()
        if value is False:
            return None
        return value


@dataclass(frozen=True)
class Placement:
    """Which node holds each node's mirror, and why some nodes have none."""

    holder_of: Mapping[int, int] = field(default_factory=dict)
    """Owner node -> the node holding its mirror."""
    refused: Mapping[int, str] = field(default_factory=dict)
    """Owner node -> why it has no mirror (a lone node; a partner on the same host)."""


def _pairing_order(nodes: list[int], stride: int) -> list[int]:
    """Nodes in the order they are paired: with a stride, column by column (0, s, 2s, ..., 1, ...)."""
    if stride <= 1:
        return nodes
    positions = sorted(range(len(nodes)), key=lambda p: (p % stride, p // stride))
    return [nodes[p] for p in positions]


def place(hosts: Mapping[int, str], *, stride: int = 1) -> Placement:
    """The placement for nodes ``hosts`` (node index -> host identity); see the module docstring."""
    if stride < 1:
        raise ValueError(f"mirror stride must be >= 1, got {stride}")
    order = _pairing_order(sorted(hosts), stride)
    if len(order) < 2:
        return Placement({}, {n: "a single node has no partner to mirror to" for n in order})
    holder_of: dict[int, int] = {}
    paired = len(order) if len(order) % 2 == 0 else len(order) - 3
    for i in range(0, paired, 2):
        a, b = order[i], order[i + 1]
        holder_of[a], holder_of[b] = b, a
    if paired < len(order):  # odd: a ring of the last three
        ring = order[paired:]
        for i, owner in enumerate(ring):
            holder_of[owner] = ring[(i + 1) % len(ring)]
    refused: dict[int, str] = {}
    for owner, holder in list(holder_of.items()):
        if hosts[owner] == hosts[holder]:
            refused[owner] = (
                f"partner node {holder} is on the same host ({hosts[owner]}): a mirror there would"
                " be lost with the node it protects"
            )
            del holder_of[owner]
    return Placement(holder_of, refused)


__all__ = ["Placement", "place"]
