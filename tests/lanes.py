"""Test lanes, applied automatically: nobody has to remember a marker.

Three lanes (``pyproject.toml`` declares the markers, the Makefile runs them):

* **quick** (``make quick``): every test that runs inside the pytest process. This is the lane to run
  after each edit; it must stay under a minute on two cores.
* ``procs``: tests that start processes: multi-rank gloo jobs (:func:`tests.workers.run_ranks`),
  forked children, CLI and sidecar subprocesses, ``torchrun`` trainings, external tools, DCP's
  ``PROCESS`` checkpointer.
* ``s3server``: tests that need the real S3 server (SeaweedFS, started by a fixture).

``slow`` is for in-process tests that are slow by design (long sweeps); ``make quick`` skips them too.

How a test's lane is found, at collection: the test function, the fixtures it uses and, through their
code, every helper function or class of the ``tests`` package they reach are scanned for the names
that start processes (:data:`PROCESS_MODULES`, :data:`PROCESS_STARTERS`) or for the S3 server's
fixture. A parameter that asks for DCP's ``PROCESS`` checkpointer counts too.

What the scan misses, the guard catches: a test left in the quick lane that starts a process fails
at once, naming what it started, instead of quietly slowing the lane down.
"""

from __future__ import annotations

import enum
import inspect
import multiprocessing.process
import os
import subprocess
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PROCS, S3SERVER, SLOW = "procs", "s3server", "slow"
PROCESS_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
"""A reference to one of these modules means the code starts processes."""
S3SERVER_FIXTURES = frozenset({"seaweed", "seaweed_bucket", "real_s3"})
"""Fixtures that start (or use) the real S3 server."""


def _starters() -> set[Callable[..., Any]]:
    from tests.forked import in_forked_child
    from tests.workers import run_ranks

    return {run_ranks, in_forked_child, os.fork, os.posix_spawn, os.execv}


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(obj: object) -> list[types.FunctionType]:
    """The Python functions behind ``obj``: itself, or a class's methods (wrappers unwrapped)."""
    if isinstance(obj, type):
        found = []
        for member in vars(obj).values():
            inner = member.__func__ if isinstance(member, staticmethod | classmethod) else member
            inner = inner.fget if isinstance(inner, property) else inner
            if isinstance(inner, types.FunctionType):
                found.append(inner)
        return found
    obj = inspect.unwrap(obj) if callable(obj) else obj  # type: ignore[arg-type]
    return [obj] if isinstance(obj, types.FunctionType) else []


class _Scan:
    """Follows references from test code through the ``tests`` package (each function once)."""

    def __init__(self) -> None:
        self.starters = _starters()
        self.seen: dict[types.FunctionType, str | None] = {}

    def reason(self, obj: object) -> str | None:
        """Why ``obj`` (a function or class) starts processes, or None."""
        for function in _functions_of(obj):
            found = self._function(function)
            if found:
                return found
        return None

    def _function(self, function: types.FunctionType) -> str | None:
        if function in self.seen:
            return self.seen[function]
        self.seen[function] = None  # recursion guard
        found = self._scan(function)
        self.seen[function] = found
        return found

    def _scan(self, function: types.FunctionType) -> str | None:
        names = {n for code in _code_objects(function.__code__) for n in code.co_names}
        closure = [c.cell_contents for c in function.__closure__ or () if _has_contents(c)]
        targets = [function.__globals__[n] for n in names if n in function.__globals__] + closure
        for target in targets:
            if isinstance(target, types.ModuleType):
                if target.__name__ in PROCESS_MODULES:
                    return f"{function.__qualname__} uses {target.__name__}"
                for name in names:  # module.attribute: os.fork
                    if _is_starter(getattr(target, name, None), self.starters):
                        return f"{function.__qualname__} calls {target.__name__}.{name}"
                continue
            if callable(target) and _is_starter(target, self.starters):
                return f"{function.__qualname__} calls {getattr(target, '__name__', target)}"
            if _in_tests(target):
                found = self.reason(target)
                if found:
                    return found
        return None


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _is_starter(target: object, starters: set[Callable[..., Any]]) -> bool:
    try:
        return target in starters
    except TypeError:  # unhashable
        return False


def _in_tests(target: object) -> bool:
    module = getattr(target, "__module__", None) or ""
    # this module names every starter without starting anything
    return (module == "tests" or module.startswith("tests.")) and module != __name__


def _process_parameter(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    for value in callspec.params.values() if callspec else ():
        if isinstance(value, enum.Enum) and value.name == "PROCESS":
            return f"parameter {value!r} runs DCP's checkpoint process"
    return None


def classify(item: pytest.Item, scan: _Scan) -> dict[str, str]:
    """``{marker: why}`` for the lanes ``item`` belongs to beyond the quick one."""
    lanes: dict[str, str] = {}
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & S3SERVER_FIXTURES:
        lanes[S3SERVER] = f"uses fixture(s) {sorted(fixtures & S3SERVER_FIXTURES)}"
    function = getattr(item, "function", None)
    why = _process_parameter(item) or (scan.reason(function) if function else None)
    if why is None:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in sorted(fixtures - {"_quick_lane_guard"}):
            for definition in definitions.get(name, ()):
                if found := scan.reason(definition.func):
                    why = f"fixture {name}: {found}"
                    break
            if why:
                break
    if why:
        lanes[PROCS] = why
    return lanes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every collected test with its lanes (see the module docstring)."""
    scan = _Scan()
    for item in items:
        for marker, why in classify(item, scan).items():
            item.add_marker(getattr(pytest.mark, marker))
            item.user_properties.append((f"lane:{marker}", why))


class LaneError(AssertionError):
    """A test in the quick lane started a process."""


@pytest.fixture(autouse=True)
def _quick_lane_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a quick-lane test that starts a process: the lane scan missed it (fix the scan)."""
    if request.node.get_closest_marker(PROCS) is not None:
        return
    name = request.node.nodeid

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*_args: Any, **_kwargs: Any) -> Any:
            raise LaneError(
                f"{name} starts a process ({what}) but the lane scan put it in the quick lane:"
                " teach tests/lanes.py how to see it"
            )

        return refused

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("Process.start"))
    monkeypatch.setattr(os, "fork", refuse("os.fork"))
