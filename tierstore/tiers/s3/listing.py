"""Listing one named file in every child of an S3 prefix without listing the data between them.

A checkpoint's marker is ``<id>/commit.json``; its data is ``<id>/<generation>/...``, every rank's
files of every generation. A plain listing pages through all of it: one request per 1,000 objects,
so the marker scan of 1,000 checkpoints of 1,024 ranks takes a thousand requests. S3 rolls keys up
at a *delimiter*, and the delimiter may be any string: with ``/g`` (every generation directory's
name starts with ``g``: :func:`tierstore.ids.new_generation`), a checkpoint's data comes back as
one common prefix ``<id>/g``, and the scan costs a request per ~300 checkpoints, however many ranks.

A child named ``besides`` (tierstore's own ``.tierstore/``: the commit log, a key per commit) is
not paged through either: the listing stops at its first key and goes on after its last
(``StartAfter``), a page at most instead of one per thousand commits.

A store that rolls up only at ``/`` (or not at all) answers with the keys themselves: they are
filtered here, so the answer is the same, only not cheaper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tierstore.tiers.base import FileInfo

ROLL_UP = "/g"
"""The delimiter: what follows a child's name when the key is inside a generation directory."""


def named_in_children(
    list_page: Callable[[dict[str, Any]], dict[str, Any]],
    prefix: str,
    name: str,
    mtime: Callable[[dict[str, Any]], float],
    *,
    besides: str | None = None,
) -> dict[str, FileInfo]:
    """``{child: info}`` for each ``<prefix><child>/<name>``, by paginated ``ListObjectsV2`` calls.

    ``list_page(kwargs)`` makes one ``list_objects_v2`` call (the caller adds the bucket and its
    retries); ``prefix`` is the tier's key prefix with its trailing ``/`` (or ``""``); ``mtime``
    turns a listed object into its modification time. ``name`` must not start with ``g`` (it would
    be rolled up with the data): the caller lists plainly then.
    """
    found: dict[str, FileInfo] = {}
    skip = None if besides is None else f"{prefix}{besides}/"
    for item in _objects(list_page, prefix, skip):
        parts = str(item["Key"])[len(prefix) :].split("/")
        if len(parts) == 2 and parts[1] == name:
            found[parts[0]] = FileInfo(f"{parts[0]}/{name}", int(item["Size"]), mtime(item))
    return found


def _objects(
    list_page: Callable[[dict[str, Any]], dict[str, Any]], prefix: str, skip: str | None
) -> Iterator[dict[str, Any]]:
    """Every key under ``prefix``, but those under ``skip`` (a prefix ending in ``/``). Met on a
    page with more to come, they are jumped over: the listing starts again after them, ``StartAfter``
    ``skip + "~"``. That is past every key under ``skip`` whose next character is below ``~`` (every
    name tierstore writes there) in S3's key order, where the children sorting before ``skip`` were
    listed already; and in a store that lists by walking directories (SeaweedFS), where they come
    after ``skip``'s keys, it goes on with the next child. On the last page they are only left out."""
    token: str | None = None
    after: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": ROLL_UP}
        if token:
            kwargs["ContinuationToken"] = token
        elif after:
            kwargs["StartAfter"] = after
        page = list_page(kwargs)
        token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        jump = False
        for item in page.get("Contents", []):
            if skip is not None and str(item["Key"]).startswith(skip):
                jump = token is not None and after is None
                if jump:
                    break
                continue
            yield item
        if jump and skip is not None:
            after, token = f"{skip}~", None
        elif token is None:
            return
