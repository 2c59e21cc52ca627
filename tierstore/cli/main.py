"""The ``tierstore`` command: list, verify, export, promote and clean up checkpoints.

``tierstore --config FILE COMMAND ...`` (``--config`` defaults to ``$TIERSTORE_CONFIG``). Tables are for
people; ``--json`` is for machines. Errors print one line, ``tierstore: error: ...``, and exit with 2;
``verify`` and ``restore`` exit with 1 when a stored file does not match its marker. ``restore`` and
``drill`` import torch only when they run: the other commands never load it. Each command:
docs/operations.md, "The command line".
"""

from __future__ import annotations

import argparse
import errno
import functools
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tierstore._platform.bounded import Prober
from tierstore._platform.progress import ByteProgress
from tierstore.cli.audit import audit_all
from tierstore.cli.status import gather_status, render
from tierstore.config import Config, load_config
from tierstore.dcp.arguments import check_drill_arguments, check_export_destination
from tierstore.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    TierstoreError,
    TierUnavailableError,
    one_line,
)
from tierstore.ids import validate_checkpoint_id
from tierstore.interval import advise
from tierstore.promote.cleanup import VOID_BELOW_TOP, Cleanup
from tierstore.promote.discovery import foreign_parts
from tierstore.promote.sidecar import Promoter, event
from tierstore.records.catalog import Catalog, Listing
from tierstore.records.marker import Manifest, copy_problems, read_manifest
from tierstore.records.protocol import drop
from tierstore.tiers import Tier
from tierstore.topology import current_node
from tierstore.units import human_age, human_bytes, parse_duration

READ_ONLY = frozenset({"ls", "status", "verify", "advise"})
"""Commands that never write into a tier."""
EXIT_MISMATCH = 1
EXIT_ERROR = 2


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def cmd_ls(config: Config, args: argparse.Namespace) -> int:
    """List committed checkpoints, newest first (``--watch``: again every interval until ^C)."""
    if not args.watch:
        return _print_listing(config, args)
    # ^C (the way a watch ends: not an error) lets the listing in progress finish: interrupting
    # it mid-request could leave an S3 client's event loop busy and the process unable to exit.
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set():
            print(f"-- {time.strftime('%Y-%m-%d %H:%M:%S')} --")
            _print_listing(config, args)
            sys.stdout.flush()  # a pipe or a log file sees each listing as it is made
            stop.wait(args.interval)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _print_listing(config: Config, args: argparse.Namespace) -> int:
    catalog = Catalog(config, node=args.node)
    listings = catalog.listings(limit=args.limit or None)
    for name, why in sorted(catalog.unreachable.items()):  # what it could reach is still listed
        state = "refuses (a configuration to fix)" if name in catalog.refused else "is unreachable"
        print(f"tierstore: tier {name} {state}, not listed: {why}", file=sys.stderr)
    status = EXIT_ERROR if catalog.refused else 0  # an outage is reported; a misconfiguration fails
    last = config.tiers[-1].name
    # While the durable tier does not answer, whether a checkpoint is in it is unknown, not "no".
    known = last not in catalog.unreachable

    def durable(entry: Listing) -> bool | None:
        return last in entry.tiers if known else None

    if args.json:  # one line per listing when watching, so each refresh is one JSON document
        indent = None if args.watch else 1
        print(json.dumps([{**e.as_dict(), "durable": durable(e)} for e in listings], indent=indent))
        return status
    if not listings:
        print("no committed checkpoints")
        return status
    rows = [("ID", "STEP", "TIERS", "DURABLE", "SIZE", "AGE")]
    now = time.time()
    for entry in listings:
        step = "-" if entry.step is None else str(entry.step)
        age = human_age(now - entry.committed_at)
        held = {True: "yes", False: "no", None: "?"}[durable(entry)]
        rows.append((entry.checkpoint_id, step, ",".join(entry.tiers), held, human_bytes(entry.bytes), age))
    print_table(rows)
    if args.limit and len(listings) == args.limit:
        print(f"(the newest {args.limit} shown; --limit 0 lists every checkpoint)")
    return status


def cmd_status(config: Config, args: argparse.Namespace) -> int:
    """Show each tier, the recovery point, the mirrors and the promoters (exit 1 if a problem)."""
    report = gather_status(config, args.nodes or [current_node(args.node)], max_lag=args.max_lag)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print("\n".join(render(report)))
    return 0 if report.ok else EXIT_MISMATCH


def cmd_verify(config: Config, args: argparse.Namespace) -> int:
    """Check sizes and CRC32C of every file of a checkpoint in every tier holding it (``--all``:
    of every committed copy in every tier)."""
    if args.all:
        return _verify_all(config, args)
    if args.checkpoint_id is None:
        raise TierstoreError("verify: name a checkpoint ID, or pass --all")
    checkpoint_id = validate_checkpoint_id(args.checkpoint_id)
    catalog = Catalog(config, node=args.node)
    prober = Prober(config.probe_timeout)  # a hung tier is named and left, after one deadline
    holders, bad, away = 0, 0, []
    for tier in catalog.tiers:
        check = functools.partial(_verify_copy, tier, checkpoint_id, catalog)
        try:
            held = prober.watch(tier, check, what=f"verify {checkpoint_id}")
        except IntegrityError as exc:  # a damaged marker is a mismatch; an unreachable tier an error
            print(f"{tier.name}: MISMATCH {exc}")
            bad += 1
            continue
        except TierUnavailableError as exc:
            print(f"{tier.name}: UNREACHABLE {one_line(str(exc))}")
            away.append(tier.name)
            continue
        if held is None:
            continue
        holders += 1
        manifest, checked, problems = held
        skipped = len(manifest.files) - checked
        note = f" ({skipped} files on other nodes not checked)" if skipped else ""
        bad += bool(problems)
        for problem in problems:
            print(f"{tier.name}: MISMATCH {problem}")
        if not problems:
            print(f"{tier.name}: ok, {checked} files, {human_bytes(manifest.total_bytes)}{note}")
    if bad:
        return EXIT_MISMATCH
    if away:
        raise TierUnavailableError(
            f"verify {checkpoint_id}: tiers {', '.join(away)} did not answer", tier=away[0]
        )
    if holders == 0:
        raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not committed in any tier")
    return 0


def _verify_copy(
    tier: Tier, checkpoint_id: str, catalog: Catalog, progress: Callable[[int], None]
) -> tuple[Manifest, int, list[str]] | None:
    """The marker of ``checkpoint_id`` in ``tier``, the files checked (this node's) and the problems
    found in them; None where the tier does not hold it. ``progress`` is told of each chunk read."""
    try:
        manifest = read_manifest(tier, checkpoint_id, trust=catalog.trust)
    except FileNotFoundError:
        return None
    progress(0)
    here = [f for f in manifest.files if not tier.node_local or f.node == catalog.node]

    def told(count: int) -> None:
        bar.update(count)
        progress(count)

    with ByteProgress(f"verify {checkpoint_id} in {tier.name}", sum(f.size for f in here)) as bar:
        problems = copy_problems(tier, manifest, verify=True, entries=here, progress=told)
    return manifest, len(here), problems


def _verify_all(config: Config, args: argparse.Namespace) -> int:
    nodes = args.nodes or [current_node(args.node)]
    audits = audit_all(config, nodes, show_progress=True, prober=Prober(config.probe_timeout))
    away = sorted({a.tier for a in audits if a.unreachable})
    if args.json:
        print(json.dumps([{**asdict(a), "ok": a.ok} for a in audits], indent=1))
    else:
        for audit in audits:
            where = f"{audit.tier}: {audit.checkpoint_id}" if audit.checkpoint_id else audit.tier
            if audit.unreachable:
                print(f"{where}: UNREACHABLE {audit.unreachable}")
            elif audit.ok:
                note = f", {audit.not_checked} on other nodes not checked" if audit.not_checked else ""
                print(f"{where}: ok, {audit.checked} files, {human_bytes(audit.total_bytes)}{note}")
            for problem in audit.problems:
                print(f"{where}: MISMATCH {problem}")
        copies = [a for a in audits if a.checkpoint_id and not a.unreachable]
        bad = sum(not a.ok for a in copies)
        print(f"{len(copies)} committed copies, {bad} with a marker over missing or wrong data")
    if any(not a.ok for a in audits):
        return EXIT_MISMATCH
    if away:
        raise TierUnavailableError(f"verify --all: tiers {', '.join(away)} did not answer", tier=away[0])
    return 0


def cmd_restore(config: Config, args: argparse.Namespace) -> int:
    """Export a committed checkpoint to a plain DCP directory (exit 1 if a source file is corrupt)."""
    validate_checkpoint_id(args.checkpoint_id)  # arguments first: importing torch takes seconds
    if args.tier is not None:
        config.tier(args.tier)
    check_export_destination(Path(os.path.abspath(args.to)))
    from tierstore.dcp.tools import export_checkpoint  # loads torch: only for this command

    # A stopped export (timeout, job kill) must clean up its temporary directory like any failure.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = export_checkpoint(
            config, args.checkpoint_id, args.to, tier=args.tier, node=args.node, show_progress=True
        )
    except IntegrityError as exc:
        print(f"tierstore: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_MISMATCH
    except CheckpointNotFoundError as exc:
        held = _committed_ids(config, args.node, args.tier, args.checkpoint_id)
        raise CheckpointNotFoundError(f"{one_line(str(exc))}{held}") from None
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(
            f"restored {report.checkpoint_id} from {report.tier} to {report.destination}:"
            f" {report.files} files, {human_bytes(report.bytes)} in {report.seconds:.2f} s"
        )
    return 0


_IDS_SHOWN = 5
"""Ids a "not found" message lists at most."""


def _committed_ids(config: Config, node: int | None, tier: str | None, wanted: str) -> str:
    """What the tiers searched do hold, for a restore of an id none holds (``""`` when they hold
    ``wanted`` but no usable copy: the reasons already say why)."""
    searched = config.model_copy(update={"tiers": (config.tier(tier),)}) if tier else config
    ids = [entry.checkpoint_id for entry in Catalog(searched, node=node).listings()]
    where = f"tier {tier}" if tier else "the tiers searched"
    if wanted in ids:
        return ""
    if not ids:
        return f"; nothing is committed in {where}"
    more = f" and {len(ids) - _IDS_SHOWN} more" if len(ids) > _IDS_SHOWN else ""
    return f"; committed in {where}, newest first: {', '.join(ids[:_IDS_SHOWN])}{more}"


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_drill(config: Config, args: argparse.Namespace) -> int:
    """Restore a checkpoint in a separate job, train K steps, compare with the logged losses."""
    checked: dict[str, Any] = {
        "entry": args.entry,
        "loss_log": args.loss_log,
        "world_size": args.world_size,
        "steps": args.steps,
        "tier": args.tier,
        "checkpoint_id": args.checkpoint,
        "tolerance": args.tolerance,
        "timeout_s": args.timeout,
    }
    check_drill_arguments(config, **checked)  # before torch, whose import takes seconds
    from tierstore.dcp.tools import run_drill  # loads torch: only for this command

    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # stops the drill's ranks, removes its files

    entry_args = list(args.entry_args)
    if entry_args[:1] == ["--"]:
        entry_args = entry_args[1:]
    report = run_drill(config, **checked, argv=entry_args, node=current_node(args.node), verbose=args.verbose)
    lines = report.prometheus()
    if args.prom_file:
        write_text_atomically(args.prom_file, "\n".join(lines) + "\n")
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        verdict = "PASS" if report.passed else "FAIL"
        rto = "-" if report.rto_s is None else f"{report.rto_s:.2f} s"
        restore = "-" if report.restore_s is None else f"{report.restore_s:.2f} s"
        read = ", ".join(f"{t} {human_bytes(n)}" for t, n in report.bytes_read.items()) or "-"
        print(
            f"drill {verdict}: {report.checkpoint_id} from {report.tier} at world size"
            f" {report.world_size}: {report.reason}"
        )
        print(f"  restore {restore}, RTO {rto}, read {read}")
        for step, loss, logged in zip(report.steps, report.losses, report.logged, strict=True):
            print(f"  step {step}: loss {loss!r} logged {logged!r}")
        if args.verbose:  # the one-line reason is the innermost error; the tracebacks say where
            for detail in report.details:
                print(f"  {detail.rstrip()}".replace("\n", "\n  "))
        print(lines[0])
    return 0 if report.passed else EXIT_MISMATCH


def write_text_atomically(path: str, text: str) -> None:
    """Write ``path`` through a temporary file and a rename (a scraper never sees half a file)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


def cmd_promote(config: Config, args: argparse.Namespace) -> int:
    """Run the promoter until SIGTERM (or one pass with --once)."""
    promoter = Promoter(config, node=args.node)
    # Before anything that asks a tier: a SIGTERM during the first look (a slow S3) stops the
    # promoter cleanly (exit 0) instead of killing it by the signal's default action.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: promoter.request_stop())
    if args.metrics_port is not None:
        try:
            port = promoter.serve(args.metrics_port, args.metrics_addr)
        except OSError as exc:  # say what is wrong, and which flag to change
            raise TierstoreError(_bind_error(args.metrics_addr, args.metrics_port, exc)) from exc
        logging.getLogger(__name__).info(
            "metrics on http://%s:%d/metrics, probes at /healthz and /readyz", args.metrics_addr, port
        )
    promoter.look()  # a tier that refuses for good (no bucket, refused credentials) stops it here
    if refused := promoter.context.availability.misconfigured:
        (tier, _doing), why = next(iter(sorted(refused.items())))
        raise TierstoreError(f"promote: tier {tier} refuses, and waiting will not change it: {why}")
    # The first and last lines of its log: a promoter with nothing to do still shows it runs.
    event(
        "promoter_started",
        node=promoter.node,
        tiers=",".join(t.name for t in promoter.tiers),
        interval=float(config.promote.interval),
        once=args.once,
    )
    status = promoter.run(once=args.once)
    event("promoter_stopped", node=promoter.node, status=status)
    return status


def _bind_error(addr: str, port: int, exc: OSError) -> str:
    """Why the promoter cannot serve on ``addr:port``: a name that does not resolve, an address
    that is not this host's, a privileged port, or a port another process holds."""
    where = f"cannot listen on {addr}:{port}: {exc.strerror or exc}"
    if isinstance(exc, socket.gaierror):
        return (
            f"--metrics-addr {addr}: not resolvable ({exc.strerror or exc}): give an IP address of"
            " this host (127.0.0.1, or 0.0.0.0 for every interface) or a name that resolves to one"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--metrics-addr {addr}: {where} (not an address of this host: 127.0.0.1, or 0.0.0.0)"
    if exc.errno == errno.EACCES:
        return f"--metrics-port {port}: {where} (ports below 1024 need privileges: choose a higher one)"
    return f"--metrics-port {port}: {where} (choose a free port with --metrics-port, or 0 for any free port)"


def cmd_gc(config: Config, args: argparse.Namespace) -> int:
    """Retention and leftover cleanup, once; ``--dry-run`` only prints. A job-wide tier is cleaned
    only when no other promoter keeps it (its keeper does); a lease taken here is given up at the end."""
    promoter = Promoter(config, node=args.node)
    try:
        return _gc(promoter, config, args)
    finally:
        promoter.context.keepers.release()


def _gc(promoter: Promoter, config: Config, args: argparse.Namespace) -> int:
    found = promoter.catalog()
    deletions = promoter.apply_retention(found, dry_run=args.dry_run)
    for deletion in deletions:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {deletion.checkpoint_id} from {deletion.tier}: {deletion.reason}")
    cleanups = promoter.collect_garbage(dry_run=args.dry_run)
    for cleanup in cleanups:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {cleanup.path} from {cleanup.tier}: {cleanup.reason}")
    if not deletions:
        print("retention: nothing to delete")
    later: list[Cleanup] = []
    if args.dry_run:  # leftovers not yet left alone long enough: what a later gc removes
        due = {(c.tier, c.path) for c in cleanups}
        later = [
            c
            for c in promoter.collect_garbage(dry_run=True, stale_after=0.0)
            if (c.tier, c.path) not in due and c.reason != VOID_BELOW_TOP
        ]
        wait = human_age(config.promote.stale_after)
        for cleanup in later:
            print(
                f"would remove later {cleanup.path} from {cleanup.tier}: {cleanup.reason}"
                f" (once left alone for promote.stale_after, {wait})"
            )
    if not cleanups and not later:
        print("cleanup: nothing to remove")
    for name in sorted(
        set(promoter.context.keepers.by_tier) - promoter.view.owned - set(promoter.unreachable)
    ):
        print(f"tierstore: tier {name} is kept by another node's promoter, which cleans it: not cleaned here")
    for name, why in sorted(promoter.unreachable.items()):  # what could be reached was done
        print(f"tierstore: tier {name} is unreachable, not cleaned: {one_line(why)}", file=sys.stderr)
    return EXIT_MISMATCH if promoter.unreachable else 0


def cmd_drop(config: Config, args: argparse.Namespace) -> int:
    """Delete one committed copy of a checkpoint from one tier, through the commit protocol (marker
    first, then its log entries, part records and data; data a restore is reading stays until it is
    done). For settling a conflict, or removing a copy by hand; retention does the rest."""
    checkpoint_id = validate_checkpoint_id(args.checkpoint_id)
    tier, trust = config.make_tier(args.tier, node=current_node(args.node)), config.marker_trust()
    if args.generation:
        return _drop_part(config, tier, checkpoint_id, args.generation)
    try:
        generation = read_manifest(tier, checkpoint_id, trust=trust).generation
    except FileNotFoundError:
        parts = sorted(foreign_parts(tier).get(checkpoint_id, {}))
        held = (
            f"; this node holds its parts of saves coordinated elsewhere (generations"
            f" {', '.join(parts)}): to drop one, pass --generation once the coordinator's node's"
            " marker is checked not to name it"
            if parts
            else ""
        )
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id!r} is not committed in tier {tier.describe()}{held}"
        ) from None
    data_gone = drop(tier, checkpoint_id, generation, trust=trust, ttl=config.promote.activity_ttl)
    print(
        f"dropped {checkpoint_id} (generation {generation}) from {tier.name}"
        + ("" if data_gone else "; its data stays while a restore reads it")
    )
    return 0


def _drop_part(config: Config, tier: Tier, checkpoint_id: str, generation: str) -> int:
    """This node's part of a multi-node save coordinated on another node (no marker here): the
    leftover of a coordinator killed mid-save. The operator names the generation, having checked
    that the coordinator's node's marker does not name it; work in progress on it keeps it."""
    if generation not in foreign_parts(tier).get(checkpoint_id, {}):
        raise CheckpointNotFoundError(
            f"tier {tier.describe()} holds no part of {checkpoint_id!r} generation {generation}"
            " saved from another node's coordinator"
        )
    ttl, trust = config.promote.activity_ttl, config.marker_trust()
    if not drop(tier, checkpoint_id, generation, trust=trust, committed=False, ttl=ttl):
        print(f"kept {checkpoint_id} (generation {generation}) in {tier.name}: work on it is live")
        return 1
    print(f"dropped this node's part of {checkpoint_id} (generation {generation}) from {tier.name}")
    return 0


def cmd_advise(config: Config, args: argparse.Namespace) -> int:
    """The save interval for a given MTBF, from the stalls measured in the markers."""
    listings = Catalog(config, node=args.node).listings(limit=args.last)
    stalls = [float(s) for entry in listings if (s := entry.timings.get("stall_s")) is not None]
    lags = [float(u) for entry in listings if (u := entry.timings.get("durable_lag_s")) is not None]
    if not stalls:
        raise TierstoreError("no committed checkpoint records a stall yet: save (dcp.async_save) first")
    stall = statistics.median(stalls)
    lag = statistics.median(lags) if lags else 0.0
    advice = advise(stall, args.mtbf, args.restart, lag)
    if args.json:
        print(json.dumps({**advice.as_dict(), "saves_measured": len(stalls)}, indent=1))
        return 0
    lag_note = f"median of {len(lags)}" if lags else "none promoted to the durable tier yet"
    print(f"measured stall C      {stall:.3f} s (median of the {len(stalls)} newest saves)")
    print(f"durability lag U      {lag:.1f} s ({lag_note})")
    print(f"MTBF M, restart R     {args.mtbf:.0f} s, {args.restart:.0f} s")
    print(f"Young  sqrt(2*C*M)    {advice.young_s:.1f} s")
    print(f"Daly   (recommended)  {advice.daly_s:.1f} s between saves")
    print(
        f"expected waste        {advice.waste:.2%} of run time (saving {advice.waste_saving:.2%},"
        f" rework {advice.waste_rework:.2%}, restart {advice.waste_restart:.2%})"
    )
    return 0


Command = Callable[[Config, argparse.Namespace], int]


def _duration(text: str) -> float:
    """Seconds from ``90``, ``500ms``, ``30s``, ``5m``, ``6h`` or ``7d``: every duration a command
    takes, read as the configuration reads them (:func:`~tierstore.units.parse_duration`)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interval(text: str) -> float:
    """A :func:`_duration` above zero."""
    seconds = _duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive interval, got {text!r}")
    return seconds


def _count(text: str) -> int:
    """A whole number >= 0."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _positive_count(text: str) -> int:
    """A whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535: a bind to anything else fails with a traceback."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535 (0: any free port), got {text!r}")
    return int(text)


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _address(text: str) -> str:
    """An IP address or a host name, without a port (which is ``--metrics-port``'s)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not _HOST_NAME.fullmatch(text) or len(text) > 253:
            port_too = " (the port goes to --metrics-port)" if ":" in text else ""
            raise argparse.ArgumentTypeError(
                f"malformed address {text!r}{port_too}: expected an IP address such as 127.0.0.1,"
                " 0.0.0.0 or ::, or a host name"
            ) from None
    return text


def _node_list(text: str) -> list[int]:
    try:
        nodes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected node indexes such as 0,1, got {text!r}") from None
    if not nodes or min(nodes) < 0:
        raise argparse.ArgumentTypeError(f"expected node indexes >= 0, got {text!r}")
    return nodes


def add_drill_parser(commands: Any) -> None:
    """``tierstore drill``: its flags, then ``--`` and the step function's own arguments."""
    drill = commands.add_parser(
        "drill", help="restore the newest checkpoint of a tier in a new job, train, compare losses"
    )
    drill.add_argument(
        "--entry",
        required=True,
        metavar="MODULE:FUNCTION",
        help="step function (module:function or path/to/file.py:function)",
    )
    drill.add_argument(
        "--loss-log",
        required=True,
        type=Path,
        metavar="FILE",
        help="the training job's JSON-lines loss log (step, loss)",
    )
    drill.add_argument(
        "--tier",
        default=None,
        metavar="NAME",
        help="restore from this tier (default: the last, most durable one)",
    )
    drill.add_argument(
        "--checkpoint", default=None, metavar="ID", help="this checkpoint (default: the newest in the tier)"
    )
    drill.add_argument("--world-size", type=_positive_count, default=1, help="processes in the drill job")
    drill.add_argument(
        "--steps",
        type=int,
        default=3,
        help="training steps after the restore (at least 3: the third is the first"
        " whose loss shows the restored LR schedule)",
    )
    drill.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest relative loss difference that passes"
    )
    drill.add_argument(
        "--timeout",
        type=_duration,
        default=600.0,
        metavar="DURATION",
        help="fail when the drill job runs longer: seconds, or 90s, 10m (default: 10m)",
    )
    drill.add_argument(
        "--prom-file",
        default=None,
        metavar="FILE",
        help="also write the Prometheus lines here (textfile collector)",
    )
    drill.add_argument("--json", action="store_true", help="print the report as JSON")
    drill.add_argument(
        "entry_args",
        nargs=argparse.REMAINDER,
        metavar="-- ARGS",
        help="arguments for the step function (after --)",
    )
    drill.set_defaults(run=cmd_drill)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands register themselves here)."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__.splitlines()[0])
    add_global_options(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("--json", action="store_true", help="print JSON objects")
    ls.add_argument("--watch", action="store_true", help="list again every interval until ^C")
    ls.add_argument(
        "--limit",
        type=_count,
        default=50,
        metavar="N",
        help="list the newest N checkpoints (default 50; 0: all)",
    )
    ls.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        metavar="S",
        help="with --watch: seconds between listings, or 500ms, 1m (default: 2s)",
    )
    ls.set_defaults(run=cmd_ls)
    status = commands.add_parser(
        "status", help="tiers, recovery point, mirrors and promoters at a glance (exit 1: problems)"
    )
    status.add_argument(
        "--nodes",
        type=_node_list,
        default=None,
        metavar="N,N",
        help="show the node-local tiers, mirrors and promoters of these nodes (default: this one)",
    )
    status.add_argument(
        "--max-lag",
        type=_interval,
        default=None,
        metavar="DURATION",
        help="a recovery point older than this (1h, 30m) is a problem: exit 1",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(run=cmd_status)
    verify = commands.add_parser("verify", help="check sizes and CRC32C of a checkpoint (or --all)")
    verify.add_argument("checkpoint_id", metavar="ID", nargs="?")
    verify.add_argument("--all", action="store_true", help="every committed copy in every tier")
    verify.add_argument(
        "--nodes",
        type=_node_list,
        default=None,
        metavar="N,N",
        help="with --all: audit node-local tiers of these nodes (each file on its own node)",
    )
    verify.add_argument("--json", action="store_true", help="with --all: print JSON objects")
    verify.set_defaults(run=cmd_verify)
    restore = commands.add_parser(
        "restore", help="write a committed checkpoint as a plain DCP directory (torch's reader)"
    )
    restore.add_argument("checkpoint_id", metavar="ID")
    restore.add_argument("--to", required=True, metavar="DIR", help="new (or empty) directory")
    restore.add_argument(
        "--tier", default=None, metavar="NAME", help="only this tier (default: the fastest usable)"
    )
    restore.add_argument("--json", action="store_true", help="print a JSON summary")
    restore.set_defaults(run=cmd_restore)
    add_drill_parser(commands)
    promote = commands.add_parser("promote", help="run the promoter sidecar")
    promote.add_argument("--once", action="store_true", help="one pass, then exit (cron, tests)")
    promote.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics and the /healthz, /readyz probes",
    )
    promote.add_argument(
        "--metrics-addr",
        type=_address,
        default="127.0.0.1",
        help="address to serve on (0.0.0.0: other hosts too)",
    )
    promote.set_defaults(run=cmd_promote)
    gc = commands.add_parser("gc", help="apply retention and remove uncommitted leftovers")
    gc.add_argument("--dry-run", action="store_true", help="show what would be deleted, and why")
    gc.set_defaults(run=cmd_gc)
    dropping = commands.add_parser(
        "drop", help="delete one committed copy from one tier (marker first), e.g. to settle a conflict"
    )
    dropping.add_argument("checkpoint_id", metavar="ID")
    dropping.add_argument("--tier", required=True, help="the tier to delete the copy from")
    dropping.add_argument(
        "--generation",
        help="drop this node's part of that generation, saved from another node's coordinator"
        " (a coordinator killed mid-save leaves it; check its node's marker does not name it)",
    )
    dropping.set_defaults(run=cmd_drop)
    advice = commands.add_parser("advise", help="save interval from the measured stall (Young/Daly)")
    advice.add_argument(
        "--mtbf",
        type=_interval,
        required=True,
        metavar="DURATION",
        help="mean time between failures of the job: seconds, or 30m, 6h, 2d",
    )
    advice.add_argument(
        "--restart",
        type=_duration,
        default=0.0,
        metavar="DURATION",
        help="time to restart and restore: seconds, or 90s, 5m (default: 0)",
    )
    advice.add_argument(
        "--last",
        type=_positive_count,
        default=20,
        metavar="N",
        help="use the N newest checkpoints' stalls (default 20)",
    )
    advice.add_argument("--json", action="store_true", help="print JSON")
    advice.set_defaults(run=cmd_advise)
    for command in commands.choices.values():  # `ls --config F` as well as `--config F ls`
        add_global_options(command, after_command=True)
    return parser


def add_global_options(parser: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """``--config``, ``--node``, ``-v``, ``-q``: on the main parser with their defaults; on each
    command's parser (``after_command``) without any, so that given there they override, and not
    given they leave what was given before the command."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if after_command else value

    parser.add_argument(
        "--config",
        default=default(os.environ.get("TIERSTORE_CONFIG")),
        help="YAML configuration (default: $TIERSTORE_CONFIG)",
    )
    parser.add_argument("--node", type=int, default=default(None), help="node index for node-local tiers")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="debug detail from tierstore, INFO from the libraries it uses;"
        " drill: the failed ranks' tracebacks",
    )
    loudness.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default(False),
        help="warnings and errors only (promote logs each action at INFO)",
    )


DAEMONS = frozenset({"promote"})
"""Commands that run unattended: their INFO lines (a promotion, a deletion, a cleanup each) are the
record of what happened, so they log at INFO unless ``-q``. The others print what they did."""
RETRY_LOGGER = "tierstore.tiers.s3.retry"
"""Where each failed attempt of a retried request is logged: detail for a long transfer or a
daemon's log. The read-only commands report a tier that did not answer themselves (one line), so
they show the attempts only with ``-v``."""
CATALOG_LOGGER = "tierstore.records.catalog"
"""Where the catalog says it left an unreachable tier out: :data:`LISTINGS` print that themselves."""
LISTINGS = frozenset({"ls", "status"})
"""Commands whose output names each unreachable tier and why."""


def set_up_logging(args: argparse.Namespace) -> dict[str, int]:
    """Log lines to stderr: tierstore's at DEBUG with ``-v``, WARNING with ``-q``, else INFO for
    :data:`DAEMONS` and WARNING for the rest (:data:`RETRY_LOGGER`'s at ERROR for the
    :data:`READ_ONLY` commands without ``-v``, :data:`CATALOG_LOGGER`'s for :data:`LISTINGS`);
    other libraries' at INFO with ``-v``, else WARNING. Returns the levels it replaced, for
    :func:`restore_logging`."""
    if args.quiet:
        level = logging.WARNING
    elif args.verbose:
        level = logging.DEBUG
    else:
        level = logging.INFO if args.command in DAEMONS else logging.WARNING
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    levels = dict.fromkeys({"tierstore", __name__}, level)  # `python -m tierstore.cli`: this too
    if args.command in READ_ONLY and not args.verbose:
        levels[RETRY_LOGGER] = logging.ERROR
    if args.command in LISTINGS and not args.verbose:
        levels[CATALOG_LOGGER] = logging.ERROR
    replaced = {}
    for name, wanted in levels.items():
        replaced[name] = logging.getLogger(name).level
        logging.getLogger(name).setLevel(wanted)
    return replaced


def restore_logging(replaced: dict[str, int]) -> None:
    """Put back the levels :func:`set_up_logging` replaced (``main`` called in-process, twice)."""
    for name, level in replaced.items():
        logging.getLogger(name).setLevel(level)


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
"""What a shell reports for a command whose reader closed the pipe."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run a command; one-line errors with exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose and args.quiet:  # one before the command, one after it
        parser.error("-v and -q contradict each other: pass one")
    replaced = set_up_logging(args)
    try:
        if not args.config:
            raise TierstoreError("no configuration: pass --config FILE or set TIERSTORE_CONFIG")
        # Commands that only read must not create tier directories or write probe files (a
        # read-only or hung mount would fail or hold them before they report anything).
        config = load_config(args.config, check_paths=args.command not in READ_ONLY)
        run: Command = args.run
        return run(config, args)
    except BrokenPipeError:
        # The reader went away (`tierstore ls | head`): stop quietly, as a Unix tool killed by
        # SIGPIPE does, and keep Python from complaining when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (TierstoreError, OSError, ValueError) as exc:
        print(f"tierstore: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        restore_logging(replaced)
