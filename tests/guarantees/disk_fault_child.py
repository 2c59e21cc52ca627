"""The trainer of ``test_disk_faults.py``, run under ``fiu-run -x`` (Debian's libfiu).

It commits ``step_1`` with no fault, then arms one POSIX fault and saves ``step_2`` through
``TieredWriter`` (``dcp.save``, or ``dcp.async_save`` in THREAD mode waited on with a timeout), disarms
it and prints one JSON line: how the save ended, the exception's type and message, and how many calls
the fault hit. The parent checks the tier afterwards, with no fault preloaded.

A fault is scoped to the tier's own I/O: it hits a libc call only when the Python frames that made it
(up to and through the ones in ``tierstore/tiers/``) match a pattern. Each frame reads as
``function(subjects)``, innermost first, where the subjects are its ``str``/path locals and, for a
file descriptor local (``fd``, ``self.fd``), the file it is open on. So ``^write\\(.*\\.distcp``
hits the writes of data files and ``^fsync_dir\\(.* publish\\(.*commit\\.json`` the directory fsync
after a marker's link; stderr, imports and torch never see the fault.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import errno
import json
import os
import re
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, load_config

ASYNC_TIMEOUT_S = 60.0
"""How long the child waits for ``async_save``'s future before it reports a hang."""
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_uint),
)


def train_state(step: int) -> dict[str, Any]:
    """A deterministic state: the parent rebuilds it to check a restore bit-exact."""
    generator = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(1 << 18, generator=generator),
        "counts": torch.randint(0, 1 << 40, (1024,), generator=generator, dtype=torch.int64),
        "blob": bytes([step % 256]) * 4096,
        "step": step,
    }


def _subjects(frame: types.FrameType) -> list[str]:
    found: list[str] = []
    for name, value in frame.f_locals.items():
        fd = getattr(value, "fd", None) if name == "self" else value if name == "fd" else None
        if isinstance(fd, int) and fd >= 0:
            with suppress(OSError):
                found.append(os.readlink(f"/proc/self/fd/{fd}"))
        elif isinstance(value, (str, os.PathLike)):
            found.append(os.fspath(value))  # type: ignore[arg-type]
    return found


def describe_call(frame: types.FrameType | None) -> str | None:
    """``function(subjects) caller(subjects) ...``: the frames up to and through the tier's own
    (``tierstore/tiers/``) ones; None for a call the tier did not make."""
    parts: list[str] = []
    in_tier = False
    while frame is not None and len(parts) < 12:
        if f"{os.sep}tierstore{os.sep}tiers{os.sep}" in frame.f_code.co_filename:
            in_tier = True
        elif in_tier:
            break
        parts.append(f"{frame.f_code.co_name}({' '.join(_subjects(frame))})")
        frame = frame.f_back
    return " ".join(parts) if in_tier else None


@contextmanager
def fault(point: str, error: int, pattern: str) -> Iterator[list[str]]:
    """Fail the libfiu failure point ``point`` with ``error`` for calls matching ``pattern``.

    Yields the list of calls it failed (their descriptions), filled while armed.
    """
    lib = ctypes.CDLL("libfiu.so.0")  # loaded already by fiu-run's preload: the same instance
    hits: list[str] = []
    regex = re.compile(pattern)

    def decide(_name: bytes, _failnum: Any, _failinfo: Any, _flags: Any) -> int:
        try:
            call = describe_call(sys._getframe(1))
        except Exception:  # noqa: BLE001 - a thread with no Python frame: not the tier's call
            return 0
        if call is None or not regex.search(call):
            return 0
        hits.append(call)
        return 1

    callback = _CALLBACK(decide)
    lib.fiu_enable_external.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_uint,
        _CALLBACK,
    ]
    lib.fiu_disable.argtypes = [ctypes.c_char_p]
    if lib.fiu_enable_external(point.encode(), 1, error or None, 0, callback) != 0:
        raise RuntimeError(f"libfiu refused to enable {point!r}")
    try:
        yield hits
    finally:
        lib.fiu_disable(point.encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("mode", choices=["save", "async", "load"])
    parser.add_argument("point", help="a libfiu failure point, or 'none'")
    parser.add_argument("errno", help="errno name the failing call sets (EIO, ...), or '-'")
    parser.add_argument("pattern", help="regex over the call's description (see module doc)")
    args = parser.parse_args()
    config = load_config(args.config)
    dcp.save(train_state(1), storage_writer=TieredWriter(config), checkpoint_id="step_1")
    report: dict[str, Any] = {}
    error = 0 if args.errno == "-" else getattr(errno, args.errno)
    with fault(args.point, error, args.pattern) if args.point != "none" else _none() as hits:
        try:
            if args.mode == "load":  # restore step_1 while the fault is armed
                state = {
                    k: v.zero_() if isinstance(v, torch.Tensor) else v for k, v in train_state(1).items()
                }
                dcp.load(state, storage_reader=TieredReader(config), checkpoint_id="step_1")
            elif args.mode == "save":
                dcp.save(train_state(2), storage_writer=TieredWriter(config), checkpoint_id="step_2")
            else:
                future = dcp.async_save(
                    train_state(2), storage_writer=TieredWriter(config), checkpoint_id="step_2"
                )
                future.result(timeout=ASYNC_TIMEOUT_S)
            report["outcome"] = "committed"
        except concurrent.futures.TimeoutError:
            report["outcome"] = "hung"
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            report.update(outcome="raised", type=type(exc).__name__, message=str(exc))
    report["hits"] = list(hits)
    print(json.dumps(report), flush=True)
    os._exit(0)  # a hung save thread must not keep the child alive


@contextmanager
def _none() -> Iterator[list[str]]:
    yield []


if __name__ == "__main__":
    main()
