"""Where this process sits: its node index, rank and world size.

The node index picks a node-local tier's directory (``path: /dev/shm/tierstore/{node}``). It comes from,
in order: an explicit ``node=`` argument, ``TIERSTORE_NODE``, torchrun's ``GROUP_RANK``, Slurm's
``SLURM_NODEID``, else 0. These variables describe placement, not tuning: every tuning knob lives in the
YAML file.
"""

from __future__ import annotations

import os
import socket
import sys

_NODE_VARIABLES = ("TIERSTORE_NODE", "GROUP_RANK", "SLURM_NODEID")
HOST_VARIABLE = "TIERSTORE_HOST"
"""Overrides the host identity (tests and demos simulate several hosts on one machine)."""


def current_node(explicit: int | None = None) -> int:
    """The node index of this process (see the module docstring for the order of sources)."""
    if explicit is not None:
        return _non_negative(explicit, "node")
    for variable in _NODE_VARIABLES:
        value = os.environ.get(variable)
        if value not in (None, ""):
            try:
                return _non_negative(int(value), variable)
            except ValueError:
                raise ValueError(
                    f"environment variable {variable}={value!r}: expected a node index >= 0"
                ) from None
    return 0


def _non_negative(value: int, what: str) -> int:
    if value < 0:
        raise ValueError(f"{what}={value}: expected a node index >= 0")
    return value


def is_distributed() -> bool:
    """True when a default torch.distributed process group is initialised (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False  # nobody imported it, so nobody initialised a process group
    return bool(dist.is_available() and dist.is_initialized())


def current_host() -> str:
    """What identifies the machine this process runs on: ``TIERSTORE_HOST`` if set, else the
    hostname and the kernel's boot id (two containers on one host share the boot id, so a peer
    mirror is never placed on the same physical machine by mistake)."""
    override = os.environ.get(HOST_VARIABLE)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"boot:{boot}" if boot != "?" else f"host:{socket.gethostname()}"
