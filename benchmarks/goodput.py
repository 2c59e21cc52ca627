"""Training-loop goodput: what checkpointing every N steps costs a training loop, tierstore against torch.

    python benchmarks/goodput.py [--size 512MiB] [--reps 3] [--every 5] [--saves 3] [--out bench-results]

A stack of Linear layers trained with AdamW (:mod:`benchmarks.training`; state ``--size``: parameters
and both moments) runs ``--every * (--saves + 1)`` steps, saving after every ``--every``-th step but
not in the last ``--every``, once per variant:

* ``baseline``: no checkpointing, run twice per repeat (once before each executor's variants);
* ``tierstore default``: ``TieredWriter(cfg)`` into a memory tier (``async_save`` blocks for the copy);
* ``tierstore overlapped``: ``TieredWriter(cfg, overlap=True)``; the loop waits on
  ``staging_completion`` just before ``optimizer.step()``;
* ``torch default``: ``async_save`` with ``FileSystemWriter`` and torch's default stager;
* ``torch best``: the same writer with one ``DefaultStager`` (async staging, shared memory; pinned and
  non-blocking copies on CUDA) kept for the whole run; the same waiting rule as overlapped.

Every checkpointing variant runs in both ``AsyncCheckpointerType.THREAD`` and ``PROCESS`` modes, and
every variant saves into tmpfs (tierstore's memory tier, or a ``/dev/shm`` directory for torch). Writers
and stagers are created once and warmed by one save each (buffers allocated) before anything is timed.
Each repeat runs every variant once, in an order rotated from repeat to repeat, with ``--settle``
seconds between runs so that one variant's background work (tierstore preparing spare buffers, a
checkpoint process writing) does not land in the next variant's run.

The figure is the **goodput loss**: (variant's wall time - the repeat's baseline wall time) / baseline
wall time, the median over repeats; the baseline is the mean of the repeat's two baseline runs, and
their own losses (+-) show how finely the machine resolves a difference. The target: tierstore's
loss <= torch best's, in each mode.

PROCESS mode needs a process group with a CPU backend: the script starts a gloo group of one process
(file rendezvous, no port), and every variant runs under it. Writes ``goodput.json`` and ``goodput.md``
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from benchmarks.stalls import best_stager
from benchmarks.training import Run, Trainer, Variant, run_loop, tierstore_variant, torch_variant
from benchmarks.workload import quiet_warnings
from tierstore import TieredWriter
from tierstore.config import config_from_dict
from tierstore.tiers import make_tier
from tierstore.units import parse_size

BASELINE = "baseline"
MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


def make_variants(root: Path) -> tuple[list[Variant], list[Any]]:
    """Every variant (a baseline before each executor's four), and what to close at the end."""
    config = config_from_dict(
        {"namespace": "goodput", "tiers": [{"name": "ram", "type": "memory", "path": str(root / "ram")}]}
    )
    tier = make_tier(config.tiers[0], namespace="goodput", node=0)
    variants: list[Variant] = []
    closing: list[Any] = []
    for label, mode in MODES.items():
        # one baseline before each executor's four: they are far apart in every rotated order
        variants.append(Variant(f"{BASELINE}, before {label}", None, None, lambda _: None))
        default, overlapped = TieredWriter(config), TieredWriter(config, overlap=True)
        stager = best_stager()
        closing += [default, overlapped, stager]
        variants += [
            tierstore_variant(f"tierstore default, {label}", default, tier, mode),
            tierstore_variant(f"tierstore overlapped, {label}", overlapped, tier, mode),
            torch_variant(f"torch default, {label}", root / f"torch-default-{label}", mode),
            torch_variant(f"torch best, {label}", root / f"torch-best-{label}", mode, stager),
        ]
    return variants, closing


def warm_up(trainer: Trainer, variants: list[Variant], settle: float) -> None:
    """One step, then one save per variant, committed and deleted: buffers exist before timing."""
    trainer.forward_backward()
    trainer.update()
    for variant in variants:
        if variant.save is not None:
            response = variant.save(trainer.state(), "step_warmup")
            upload = getattr(response, "upload_completion", response)
            upload.result()
            variant.drop("step_warmup")
    time.sleep(settle)  # the saves' background work (spare buffers) must not slow the first run


def summarise(runs: list[list[Run]]) -> dict[str, dict[str, Any]]:
    """Per variant: the median goodput loss over repeats, each against its repeat's baseline (the mean
    of the repeat's two baseline runs; their own "loss" against that mean shows the noise floor)."""
    losses: dict[str, list[float]] = {}
    blocked: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    for repeat in runs:
        baseline = statistics.mean(run.wall_s for run in repeat if run.variant.startswith(BASELINE))
        for run in repeat:
            losses.setdefault(run.variant, []).append((run.wall_s - baseline) / baseline)
            blocked.setdefault(run.variant, []).append(run.blocked_s / max(run.saves, 1))
            walls.setdefault(run.variant, []).append(run.wall_s)
    return {
        name: {
            "goodput_loss": statistics.median(losses[name]),
            "goodput_loss_rounds": losses[name],
            "wall_s": statistics.median(walls[name]),
            "blocked_per_save_s": statistics.median(blocked[name]),
        }
        for name in losses
    }


def verdicts(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The targets: each tierstore mode's loss <= torch best's, per executor."""
    out = {}
    for label in MODES:
        best = summary[f"torch best, {label}"]["goodput_loss"]
        for kind in ("default", "overlapped"):
            ours = summary[f"tierstore {kind}, {label}"]["goodput_loss"]
            out[f"tierstore {kind} loss <= torch best loss, {label}"] = {
                "value": ours,
                "target": best,
                "met": ours <= best,
            }
    return out


def markdown(report: dict[str, Any]) -> str:
    """The goodput table and the targets, as docs/performance.md shows them."""
    args = report["arguments"]
    lines = [
        f"Training loop: {report['state_bytes'] / 2**20:.0f} MiB of state, {report['step_s']:.3f} s per"
        f" step without checkpointing, a save every {args['every']} steps ({args['saves']} per run),"
        f" median of {args['reps']} repeats.",
        "",
        "| variant | goodput loss | blocked per save | wall time |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in report["summary"].items():
        lines.append(
            f"| {name} | {100 * row['goodput_loss']:.1f} % | {row['blocked_per_save_s']:.3f} s"
            f" | {row['wall_s']:.2f} s |"
        )
    lines += ["", "| target | tierstore | torch best | |", "| --- | ---: | ---: | --- |"]
    for name, row in report["targets"].items():
        verdict = "met" if row["met"] else "missed"
        lines.append(f"| {name} | {100 * row['value']:.1f} % | {100 * row['target']:.1f} % | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB", help="training state (parameters + AdamW moments)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="saves per timed run")
    parser.add_argument("--batch", type=int, default=64, help="rows per step: sets a step's cost")
    parser.add_argument(
        "--settle", type=float, default=2.0, help="idle seconds between runs (background work ends)"
    )
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tierstore-goodput-", dir="/dev/shm"))
    dist.init_process_group("gloo", init_method=f"file://{root / 'rendezvous'}", rank=0, world_size=1)
    closing: list[Any] = []
    try:
        with quiet_warnings():
            report = measure(args, root, closing)
    finally:
        for thing in closing:
            thing.close()
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    (out / "goodput.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "goodput.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / 'goodput.json'} and {out / 'goodput.md'}")


def measure(args: argparse.Namespace, root: Path, closing: list[Any]) -> dict[str, Any]:
    """Warm up, then ``--reps`` repeats of every variant in rotated order."""
    trainer = Trainer(parse_size(args.size), args.batch)
    variants, owned = make_variants(root)
    closing += owned
    steps = args.every * (args.saves + 1)
    warm_up(trainer, variants, args.settle)
    print(
        f"goodput: {trainer.state_bytes() / 2**20:.0f} MiB of state, {len(variants)} variants,"
        f" {steps} steps each, {args.reps} repeats",
        flush=True,
    )
    runs: list[list[Run]] = []
    for index in range(args.reps):
        shift = index % len(variants)
        repeat = []
        for variant in variants[shift:] + variants[:shift]:
            run = run_loop(trainer, variant, steps, args.every, tag=f"r{index}")
            print(f"  {run.variant:<32} {run.wall_s:7.2f} s, blocked {run.blocked_s:.3f} s", flush=True)
            repeat.append(run)
            time.sleep(args.settle)
        runs.append(repeat)
    summary = summarise(runs)
    return {
        "machine": {"cores": os.cpu_count(), "torch": torch.__version__},
        "arguments": vars(args),
        "state_bytes": trainer.state_bytes(),
        "step_s": statistics.mean(row["wall_s"] for name, row in summary.items() if name.startswith(BASELINE))
        / steps,
        "summary": summary,
        "targets": verdicts(summary),
        "runs": [[run.__dict__ for run in repeat] for repeat in runs],
    }


if __name__ == "__main__":
    main()
