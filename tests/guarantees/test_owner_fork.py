"""A directory's owner lock across fork: a child the owner forked (a data-loader worker, a helper)
neither releases the owner's lock while the owner lives nor keeps it once the owner is dead.

Started as an adversarial review's reproduction: a flock belongs to the open file, and a forked child
shares it, so a SIGKILLed trainer's staging buffers (host memory) looked owned for as long as any
child it had forked lived on, and cleanup left them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.forked import in_forked_child
from tierstore.config import Config
from tierstore.tiers import Tier, make_tier

OWNED = "staging/owner"


def memory_tier(make_config: Callable[..., Config], root: Path) -> Tier:
    config = make_config("memory", tiers={"memory": {"path": str(root)}})
    return make_tier(config.tiers[0], namespace=config.namespace, node=0)


def start_owner_with_a_forked_helper(tier: Tier) -> tuple[int, int]:
    """Fork an owner of ``OWNED`` that forks a long-lived helper after taking it; both pids."""
    read, write = os.pipe()
    owner = os.fork()
    if owner == 0:  # pragma: no cover - the child process
        try:
            os.close(read)
            tier.local.own_directory(OWNED)
            helper = os.fork()
            if helper == 0:
                time.sleep(120)
                os._exit(0)
            os.write(write, f"{helper}\n".encode())
            time.sleep(120)
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as pipe:
        line = pipe.readline()
    assert line, "the owner died before taking its directory"
    return owner, int(line)


def test_a_sigkilled_owner_is_gone_even_while_a_child_it_forked_lives(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    tier = memory_tier(make_config, tmp_path / "mem")
    owner, helper = start_owner_with_a_forked_helper(tier)
    try:
        assert tier.local.owner_alive(OWNED) is True, "the fork released the owner's lock"
        os.kill(owner, signal.SIGKILL)
        os.waitpid(owner, 0)
        os.kill(helper, 0)  # the helper the owner forked still runs
        assert tier.local.owner_alive(OWNED) is False, (
            "the owner was SIGKILLed, but its directory still looks owned while its child lives"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(owner, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(owner, 0)


def test_a_child_that_exits_leaves_its_parents_lock_held(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    tier = memory_tier(make_config, tmp_path / "mem")
    owned = tier.local.own_directory("staging/mine")
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child process
            os._exit(0 if tier.local.owner_alive("staging/mine") else 3)
        _, status = os.waitpid(child, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child saw no owner"
        assert tier.local.owner_alive("staging/mine") is True, "the child's exit released our lock"
    finally:
        os.close(owned.lock)
    assert tier.local.owner_alive("staging/mine") is False


def test_a_forked_child_closes_only_lock_files_never_a_descriptor_a_closed_lock_left_to_reuse(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    tier = memory_tier(make_config, tmp_path / "mem")
    owned = tier.local.own_directory("staging/closed")
    os.close(owned.lock)  # this process is done with it: the number is free again
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert other == owned.lock, "the test needs the lock's old descriptor number reused"

        def child() -> int:
            try:
                os.fstat(other)
            except OSError:
                return 3  # the fork closed a file that is no owner lock
            return 0

        status = in_forked_child(child, deadline=30)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        os.close(other)
