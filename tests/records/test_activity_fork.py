"""An activity record belongs to the process that published it: a forked child that releases its
inherited copy (by unwinding through ``held``) must not delete the parent's record, which keeps
cleanup and retention off the work the parent is still doing (found in review)."""

from __future__ import annotations

import os
from collections.abc import Callable

from tierstore.config import Config
from tierstore.records.activity import held


def test_a_forked_child_releasing_an_inherited_record_leaves_the_parents(
    make_config: Callable[..., Config],
) -> None:
    tier = make_config("memory").make_tiers(node=0)[0]
    with held(tier, "read", "x", None) as activity:
        pid = os.fork()
        if pid == 0:  # the child unwinds through the block, as a sys.exit there would
            code = 1
            try:
                activity.release()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert tier.exists(activity.path), "the child deleted the parent's record"
    assert not tier.exists(activity.path), "the parent's own release deletes it"
