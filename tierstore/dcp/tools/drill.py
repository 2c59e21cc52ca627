"""The restore drill: prove a checkpoint restores by training from it, not by looking at it.

``tierstore drill`` restores the newest checkpoint of one tier in a separate job of ``world_size``
processes (gloo on loopback, spawned here), runs the user's step function for ``steps`` steps, and
compares each loss with the training job's loss log within ``tolerance``. The entry's contract, why a
drill runs at least :data:`MIN_STEPS` steps, the verdict and what is measured: docs/restart.md, "The
restore drill". A failed drill says why in one line per distinct cause
(:mod:`tierstore.dcp.tools.drill_cause`); the full tracebacks are in :attr:`DrillReport.details`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

from tierstore.config import Config
from tierstore.dcp.arguments import MIN_STEPS, check_drill_arguments  # noqa: F401 - MIN_STEPS: named here
from tierstore.dcp.restore import TieredReader
from tierstore.dcp.tools.drill_cause import Tee, WatchedReader, exit_cause, failure_cause, set_up_rank_logging
from tierstore.errors import CheckpointNotFoundError, TierstoreError
from tierstore.ids import validate_checkpoint_id
from tierstore.records.catalog import Catalog

logger = logging.getLogger(__name__)
DrillEntry = Callable[["DrillContext"], Iterable[tuple[int, float]]]


@dataclass
class DrillContext:
    """What the step function gets on each rank of the drill job."""

    checkpoint_id: str
    rank: int
    world_size: int
    steps: int
    argv: tuple[str, ...]
    reader: TieredReader
    restore_s: float | None = None
    restored_at: float | None = None

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Wrap the ``dcp.load`` call: the drill times it (the restore, and the RTO)."""
        started = time.monotonic()
        yield
        self.restore_s = time.monotonic() - started
        self.restored_at = time.time()


@dataclass
class DrillReport:
    """The outcome of one drill: ``passed`` is the verdict, ``reason`` says why in one line (for a
    pass: how close the losses came); ``details`` holds each failed rank's full traceback."""

    checkpoint_id: str
    tier: str
    world_size: int
    passed: bool
    reason: str
    tolerance: float
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    logged: list[float | None] = field(default_factory=list)
    max_relative_error: float | None = None
    restore_s: float | None = None
    rto_s: float | None = None
    bytes_read: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    def prometheus(self) -> list[str]:
        """Prometheus text-format lines (for a node-exporter textfile collector or a push)."""
        labels = f'checkpoint_id="{self.checkpoint_id}",tier="{self.tier}",world_size="{self.world_size}"'
        lines = [
            f"tierstore_drill_success{{{labels}}} {int(self.passed)}",
            f"tierstore_drill_last_run_timestamp_seconds{{{labels}}} {self.started_at:.3f}",
        ]
        for name, value in (
            ("rto_seconds", self.rto_s),
            ("restore_seconds", self.restore_s),
            ("max_relative_error", self.max_relative_error),
        ):
            if value is not None and math.isfinite(value):
                lines.append(f"tierstore_drill_{name}{{{labels}}} {value:.6g}")
        for source, count in sorted(self.bytes_read.items()):
            lines.append(f'tierstore_drill_bytes_read{{{labels},source_tier="{source}"}} {count}')
        return lines


def newest_in_tier(config: Config, tier: str, *, node: int, logged: dict[int, float], steps: int) -> str:
    """The newest checkpoint committed in ``tier`` (commit order) that the loss log can judge.

    A checkpoint whose id names step ``s`` needs the log to hold steps ``s+1 .. s+steps``: the newest
    checkpoint of a finished or pre-empted run has no logged future yet, and is skipped (with a log
    line) for the newest one that has. Ids without a step number are taken as they come.
    """
    only = config.model_copy(update={"tiers": (config.tier(tier),)})
    listings = Catalog(only, node=node).listings()
    if not listings:
        raise CheckpointNotFoundError(f"tier {tier}: no committed checkpoint to drill")
    for listing in listings:
        if listing.step is None or all(
            s in logged for s in range(listing.step + 1, listing.step + steps + 1)
        ):
            return listing.checkpoint_id
        logger.info(
            "drill: skipping %s: the loss log has no steps after %d yet", listing.checkpoint_id, listing.step
        )
    raise CheckpointNotFoundError(
        f"tier {tier}: no committed checkpoint has its next {steps} steps in the loss log (newest:"
        f" {listings[0].checkpoint_id}); train further, or name one with --checkpoint"
    )


def read_loss_log(path: Path) -> dict[int, float]:
    """``step -> loss`` from a JSON-lines log (the last line for a step wins)."""
    losses: dict[int, float] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TierstoreError(f"loss log {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise TierstoreError(f"loss log {path}, line {number}: not JSON") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "loss" in record:
            losses[record["step"]] = float(record["loss"])
    return losses


def resolve_entry(spec: str) -> DrillEntry:
    """``module:function`` or ``path/to/file.py:function`` -> the function.

    A file is imported as a script would run: its directory first on ``sys.path``.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise TierstoreError(f"--entry {spec!r}: expected module:function or file.py:function")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise TierstoreError(f"--entry {spec!r}: no file {path}")
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(f"_drill_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise TierstoreError(f"--entry {spec!r}: cannot import {path}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise TierstoreError(f"--entry {spec!r}: cannot import {target}: {exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise TierstoreError(f"--entry {spec!r}: {target} has no function {name!r}")
    return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Job:
    config: Config
    checkpoint_id: str
    world_size: int
    steps: int
    entry: str
    argv: tuple[str, ...]
    node: int
    workdir: str
    verbose: bool = False


def _rank_main(rank: int, job: _Job) -> None:
    """One rank of the drill job: restore through the entry, train, write the outcome to a file."""
    outcome: dict[str, Any] = {}
    set_up_rank_logging(rank, job.verbose)
    printed = Tee(sys.stderr)
    reader: WatchedReader | None = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{job.workdir}/rendezvous", rank=rank, world_size=job.world_size
        )
        # A drill proves the bytes too: every file's CRC32C is checked, whatever verify_on_load says.
        reader = WatchedReader(job.config, node=job.node, verify=True)
        ctx = DrillContext(job.checkpoint_id, rank, job.world_size, job.steps, job.argv, reader)
        entry = resolve_entry(job.entry)
        sys.argv = [Path(job.entry.rpartition(":")[0]).name, *job.argv]  # its parser's name, flags
        with contextlib.redirect_stderr(printed):
            results = [(int(s), float(v)) for s, v in entry(ctx)]
        if ctx.restore_s is None:
            raise TierstoreError("the entry never restored inside ctx.restoring()")
        if reader.chosen_tier is None:
            raise TierstoreError("the entry restored without ctx.reader")
        if reader.checkpoint_id != job.checkpoint_id:
            raise TierstoreError(
                f"the entry restored {reader.checkpoint_id}, not the drill's {job.checkpoint_id}"
            )
        outcome = {
            "results": results,
            "restore_s": ctx.restore_s,
            "restored_at": ctx.restored_at,
            "tier": reader.chosen_tier,
            "bytes_read": reader.bytes_read,
        }
    except SystemExit as exc:
        cause = exit_cause(exc, printed.getvalue(), entry=job.entry, argv=job.argv)
        outcome = {"error": cause[:2000], "traceback": "".join(traceback.format_exception(exc))}
    except BaseException as exc:  # noqa: BLE001 - reported to the drill, which decides
        cause = failure_cause(exc, fallback=reader.error if reader is not None else None)
        outcome = {"error": cause[:2000], "traceback": "".join(traceback.format_exception(exc))}
    finally:
        Path(job.workdir, f"rank{rank}.json").write_text(json.dumps(outcome))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            _exit_reported()


def _exit_reported() -> NoReturn:
    """End a rank whose outcome is on disk without interpreter shutdown.

    An entry that turns on deterministic algorithms after the drill joined its group (the example
    does) makes torch 2.13 keep that gloo group alive past ``destroy_process_group``; gloo's threads
    then free the last work objects during interpreter shutdown, which takes the GIL and aborts the
    process. The rank has nothing left to do, so it leaves without that shutdown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_drill(
    config: Config,
    *,
    entry: str,
    loss_log: Path,
    world_size: int = 1,
    steps: int = 3,
    tier: str | None = None,
    checkpoint_id: str | None = None,
    argv: Sequence[str] = (),
    tolerance: float = 1e-4,
    timeout_s: float = 600.0,
    node: int = 0,
    verbose: bool = False,
) -> DrillReport:
    """Run one drill (see the module docstring) and return its report; never raises for a failure
    of the checkpoint or of the step function, only for bad arguments (``steps`` below
    :data:`MIN_STEPS` among them). ``verbose``: the ranks log at INFO, with tracebacks."""
    check_drill_arguments(
        config,
        entry=entry,
        loss_log=loss_log,
        world_size=world_size,
        steps=steps,
        tier=tier,
        checkpoint_id=checkpoint_id,
        tolerance=tolerance,
        timeout_s=timeout_s,
    )
    tier_name = config.tier(tier).name if tier else config.tiers[-1].name
    logged = read_loss_log(loss_log)
    resolve_entry(entry)  # a typo fails here, not in every rank
    started = time.time()
    checkpoint = (
        validate_checkpoint_id(checkpoint_id)
        if checkpoint_id is not None
        else newest_in_tier(config, tier_name, node=node, logged=logged, steps=steps)
    )
    only = config.model_copy(update={"tiers": (config.tier(tier_name),)})
    report = DrillReport(checkpoint, tier_name, world_size, False, "", tolerance, started_at=started)
    with tempfile.TemporaryDirectory(prefix="tierstore-drill-") as workdir:
        job = _Job(only, checkpoint, world_size, steps, entry, tuple(argv), node, workdir, verbose)
        problem = _spawn(job, timeout_s)
        outcomes = [_read_outcome(Path(workdir, f"rank{r}.json")) for r in range(world_size)]
    report.details = [f"rank {r}:\n{o['traceback']}" for r, o in enumerate(outcomes) if "traceback" in o]
    errors = _by_cause(outcomes)
    if problem or errors:
        report.reason = problem or errors
        return report
    report.restore_s = max(o["restore_s"] for o in outcomes)
    report.rto_s = max(o["restored_at"] for o in outcomes) - started
    for outcome in outcomes:
        source = outcome["tier"]
        report.bytes_read[source] = report.bytes_read.get(source, 0) + int(outcome["bytes_read"])
    _compare(report, outcomes[0]["results"], logged)
    return report


def _spawn(job: _Job, timeout_s: float) -> str:
    """Run the ranks; return why the job failed as a whole ("" when every rank exited)."""
    context = start_processes(  # type: ignore[no-untyped-call]
        _rank_main, args=(job,), nprocs=job.world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return f"the drill job did not finish within {timeout_s:g} s"
    except ProcessExitedException as exc:
        return f"a drill rank died: {exc}"
    except ProcessRaisedException:
        return ""  # the rank wrote its error to its outcome file
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return ""


def _by_cause(outcomes: list[dict[str, Any]]) -> str:
    """``rank 0, 1: why; rank 2: why``: each distinct cause once, with the ranks it stopped."""
    ranks: dict[str, list[str]] = {}
    for rank, outcome in enumerate(outcomes):
        if "error" in outcome:
            ranks.setdefault(outcome["error"], []).append(str(rank))
    return "; ".join(f"rank {', '.join(who)}: {why}" for why, who in ranks.items())


def _read_outcome(path: Path) -> dict[str, Any]:
    try:
        outcome: dict[str, Any] = json.loads(path.read_text())
        return outcome
    except (OSError, json.JSONDecodeError):
        return {"error": "exited without reporting"}


def _compare(report: DrillReport, results: list[list[Any]], logged: dict[int, float]) -> None:
    if not results:
        report.reason = "the step function yielded no (step, loss)"
        return
    worst, problems = 0.0, []
    for step, loss in results:
        expected = logged.get(step)
        report.steps.append(step)
        report.losses.append(loss)
        report.logged.append(expected)
        if expected is None:
            problems.append(f"the loss log has no step {step}")
            continue
        error = abs(loss - expected) / max(abs(expected), 1e-12)
        if not math.isfinite(error):
            error = math.inf
        worst = max(worst, error)
        if error > report.tolerance:
            problems.append(
                f"step {step}: loss {loss!r}, logged {expected!r} (relative error"
                f" {error:.3g} > {report.tolerance:g})"
            )
    report.max_relative_error = worst
    report.passed = not problems
    if problems:
        report.reason = "; ".join(problems)
    elif worst == 0.0:
        report.reason = f"all {len(results)} losses equal the training log's"
    else:  # a pass, not a match: say how close
        report.reason = (
            f"losses within tolerance {report.tolerance:g} of the training log, max deviation"
            f" {worst:.3g} (relative)"
        )
