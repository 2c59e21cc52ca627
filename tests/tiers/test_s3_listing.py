"""The marker scan of an S3 tier pages through the ids, not through tierstore's own records: the
commit log's keys (``.tierstore/commits/…``, one per commit, sorted among the ids) are jumped over
with ``StartAfter`` once met on a page with more to come.

The store here is a list of sorted keys answering ``ListObjectsV2``'s paging (``Prefix``,
``StartAfter``, ``ContinuationToken``, 1,000 keys a page), as S3 does; the real servers answer the
same calls in tests/guarantees/test_tier_contract.py."""

from __future__ import annotations

import bisect
from typing import Any

from tierstore.tiers.s3.listing import named_in_children

PAGE = 1000


class PagedKeys:
    """Sorted keys, listed a page at a time; counts the pages asked for."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = sorted(keys)
        self.pages = 0

    def list_page(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.pages += 1
        prefix = kwargs["Prefix"]
        if "ContinuationToken" in kwargs:
            start = int(kwargs["ContinuationToken"])
        else:
            start = bisect.bisect_right(self.keys, kwargs.get("StartAfter", ""))
        under = [k for k in self.keys[start:] if k.startswith(prefix)]
        page, more = under[:PAGE], len(under) > PAGE
        answer: dict[str, Any] = {"Contents": [{"Key": k, "Size": 2} for k in page], "IsTruncated": more}
        if more:
            answer["NextContinuationToken"] = str(self.keys.index(page[-1]) + 1)
        return answer


def _scan(store: PagedKeys, besides: str | None) -> set[str]:
    return set(named_in_children(store.list_page, "ts/", "commit.json", lambda _item: 0.0, besides=besides))


def _job(ids: int, commits: int, early: list[str]) -> list[str]:
    """``ids`` committed ids (and the ``early`` ones, sorting before ``.tierstore``), ``commits``
    log entries."""
    names = [f"step_{n:08d}" for n in range(ids)] + early
    log = [f"ts/.tierstore/commits/{n:012d}~x~g1" for n in range(commits)]
    return [f"ts/{name}/commit.json" for name in names] + log + ["ts/.tierstore/changes"]


def test_the_commit_log_costs_the_marker_scan_a_page_at_most() -> None:
    early = [f"-{n}" for n in range(1500)] + [".a", ".tierstore-b"]  # a page and a half before the log
    store = PagedKeys(_job(10_000, 10_000, early))
    found = _scan(store, ".tierstore")
    assert found == {f"step_{n:08d}" for n in range(10_000)} | set(early)
    jumped = store.pages
    store.pages = 0
    assert _scan(store, None) - {".tierstore"} == found
    assert (jumped, store.pages) == (12, 22), "2 pages to the log, where it jumps; 10 of ids after it"


def test_a_tier_on_one_page_is_listed_in_one_request() -> None:
    store = PagedKeys(_job(10, 10, []))
    assert _scan(store, ".tierstore") == {f"step_{n:08d}" for n in range(10)}
    assert store.pages == 1
