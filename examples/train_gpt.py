"""Train a small character-level GPT on Shakespeare, checkpointing through tierstore; resume exactly.

Launch with torchrun (gloo on CPU, nccl when CUDA is present)::

    torchrun --nproc-per-node 2 examples/train_gpt.py --config tierstore.yaml --run-dir runs/a

Its checkpoints go through ``tierstore.CheckpointManager``: every ``--save-every`` steps, on a step all
ranks agree on, an async save of the whole training state (one ``Stateful``: model, AdamW, LR
schedule, progress, per-rank RNG states), the previous one waited for first; a commit gate refuses
non-finite or runaway losses. Rank 0 appends every step's loss to ``RUN_DIR/loss.jsonl``. On start it
resumes from the newest committed checkpoint (or ``--resume-from ID``, a rollback) and continues as if
nothing had happened: same samples, same random streams. At the end the last state is written to the
last (durable) tier.

On SIGTERM or SIGUSR1 (a pre-emption notice) in any rank it saves at the next step, waits for the
commit, and exits 0. ``drill_entry`` is the step function for ``tierstore drill``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gpt.stop  # before torch: notes SIGTERM/SIGUSR1 from now on (see gpt/stop.py)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt.data import CharCorpus
from gpt.model import CharGPT, ModelShape, next_char_loss
from gpt.state import ResumePlanner, TrainState, seed_everything
from torch.nn.parallel import DistributedDataParallel

from tierstore import CheckpointManager, LossBandGate, TieredReader, TierstoreError, load_config
from tierstore.errors import one_line

logger = logging.getLogger("train_gpt")
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"


def build_parser() -> argparse.ArgumentParser:
    """The example's flags (``tierstore drill`` passes the same ones to :func:`drill_entry`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="tierstore YAML configuration")
    parser.add_argument("--run-dir", type=Path, default=Path("run"), help="loss log and notes")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text (ASCII)")
    parser.add_argument("--steps", type=int, default=1000, help="length of the LR schedule")
    parser.add_argument("--stop-after", type=int, default=None, help="stop (and save) at this step")
    parser.add_argument("--save-every", type=int, default=50, help="save every N steps")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--resume-from", default=None, metavar="ID", help="roll back to this checkpoint instead of the latest"
    )
    parser.add_argument("--async-mode", choices=("thread", "process"), default="thread")
    parser.add_argument(
        "--loss-band", type=float, default=3.0, help="veto a save whose loss exceeds N x its running average"
    )
    return parser


def checkpoint_id(step: int) -> str:
    """The id of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


class Trainer:
    """One rank's model, data and state, and the step function shared by training and the drill."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        per_rank, rest = divmod(args.global_batch, self.world)
        if rest or per_rank % args.micro_batch:
            raise SystemExit(
                f"--global-batch {args.global_batch} must split into {self.world} ranks x whole"
                f" micro-batches of {args.micro_batch}"
            )
        self.per_rank, self.accumulate = per_rank, per_rank // args.micro_batch
        self.device = torch.device(
            f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        )
        seed_everything(args.seed)  # the same initial weights on every rank
        self.corpus = CharCorpus(args.text, ModelShape(1).context, args.seed)
        model = CharGPT(ModelShape(vocab=len(self.corpus.alphabet))).to(self.device)
        self.model = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        self.state = TrainState(model, optimizer, scheduler, self.rank, args.seed)
        seed_everything(args.seed + 1 + self.rank)  # each rank its own dropout stream

    def _lr_factor(self, step: int) -> float:
        warmup: int = max(1, self.args.warmup)
        total: int = max(self.args.steps, warmup + 1)
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    def step(self) -> float:
        """One optimizer step over the next global batch; returns its mean loss (every rank)."""
        state, model = self.state, self.model
        first = state.progress.samples_seen + self.rank * self.per_rank
        state.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for micro in range(self.accumulate):
            inputs, targets = self.corpus.batch(first + micro * self.args.micro_batch, self.args.micro_batch)
            last = micro == self.accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(inputs.to(self.device))  # through DDP: its gradient hooks
                loss = next_char_loss(logits, targets.to(self.device)) / self.accumulate
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        state.optimizer.step()
        state.scheduler.step()
        dist.all_reduce(total)
        mean = float(total) / self.world
        state.progress.record(mean, self.args.global_batch, self.args.loss_band)
        return mean

    def load(self, reader: TieredReader, checkpoint: str) -> None:
        """Restore the whole state from ``checkpoint`` (collective)."""
        dcp.load(
            {"train": self.state}, storage_reader=reader, checkpoint_id=checkpoint, planner=ResumePlanner()
        )


class LossLog:
    """Rank 0's record of every step: one JSON object per line, flushed as written."""

    def __init__(self, run_dir: Path, attempt: str) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "loss.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.attempt = attempt

    def write(self, **fields: Any) -> None:
        """Append one record (``repr`` of a float round-trips, so losses compare bit for bit)."""
        self.file.write(json.dumps({**fields, "attempt": self.attempt}) + "\n")
        self.file.flush()


def setup_distributed() -> None:
    """Join torchrun's group (gloo on CPU, nccl with CUDA); alone, make a group of one."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Deterministic kernels on one thread per rank: a resumed run repeats the losses bit for bit.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # DCP's async save needs a CPU backend next to nccl.
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


def train(args: argparse.Namespace) -> int:
    """The training loop: resume, step, log; the manager saves on agreed steps, stops cleanly on a
    stop request, and makes the last state durable before the process exits."""
    setup_distributed()
    trainer = Trainer(args)
    attempt = uuid.uuid4().hex[:8]
    log = LossLog(args.run_dir, attempt) if trainer.rank == 0 else None
    started = time.monotonic()

    def saved(checkpoint: str, error: BaseException | None) -> None:  # a vetoed save is not fatal
        if error is not None:
            logger.error("save of %s failed: %s", checkpoint, error)
        if log:
            failed = {"event": "save_failed", "error": str(error)[:500]} if error else {"event": "committed"}
            log.write(checkpoint=checkpoint, **failed)

    run = {"steps": args.steps}  # saved beside the state: the LR schedule's length
    # A resumed run is the timeline from now on: an id it reaches again (left by an abandoned
    # timeline after a rollback, or a save this job could not restore) is replaced by a new
    # generation, and the old one stays loadable until the new one commits.
    manager = CheckpointManager(
        args.config,
        {"train": trainer.state, "run": run},
        every_steps=args.save_every,
        checkpoint_id=checkpoint_id,
        async_mode=args.async_mode,
        stop_requested=lambda: bool(gpt.stop.received),  # noted since start-up (gpt/stop.py)
        on_saved=saved,
        load_planner=ResumePlanner(),
        overwrite=True,
        check_finite=True,
        commit_gate=LossBandGate(band=args.loss_band),
    )
    started = time.monotonic()
    manager.restore(args.resume_from)
    resumed_from, tier = manager.restored_from or (None, "-")
    if resumed_from is None and trainer.rank == 0:
        logger.info("no committed checkpoint: starting fresh")
    elif trainer.rank == 0:
        rollback = " (rollback: --resume-from)" if args.resume_from else ""
        logger.info(
            "resumed from %s%s, tier %s, in %.2f s", resumed_from, rollback, tier, time.monotonic() - started
        )
    if resumed_from is not None and run["steps"] != args.steps and trainer.rank == 0:
        logger.warning(
            "--steps %d differs from the %d the run was saved with: the LR schedule changes from here",
            args.steps,
            run["steps"],
        )
    run["steps"] = args.steps  # what this run's saves record
    progress = trainer.state.progress
    if log:
        log.write(
            event="start",
            resumed_from=resumed_from,
            tier=tier,
            step=progress.step,
            samples_seen=progress.samples_seen,
            world_size=trainer.world,
            restore_s=round(time.monotonic() - started, 3),
        )
    if args.resume_from:
        # Commit the rollback point again, now the newest, straight into the last (durable) tier: a
        # crash before the next save, even one that loses the faster tiers, must resume this
        # timeline and never the abandoned one, whose later checkpoints sit in those tiers.
        manager.save_durable(progress.step)
    stop_at = args.stop_after or args.steps
    while progress.step < stop_at and not manager.should_stop:
        loss = trainer.step()
        if log:
            log.write(
                event="step",
                step=progress.step,
                loss=loss,
                samples_seen=progress.samples_seen,
                world_size=trainer.world,
            )
        manager.maybe_save(progress.step)
    # A finished run ends durable; --stop-after (a pause) and a pre-emption stay in the fastest tier.
    manager.close(progress.step, durable=progress.step >= args.steps)
    if log:
        log.write(event="stop", step=progress.step, preempted=manager.should_stop)
    dist.destroy_process_group()
    return 0


def drill_entry(ctx: Any) -> Iterator[tuple[int, float]]:
    """``tierstore drill --entry examples/train_gpt.py:drill_entry -- <training flags>``.

    Builds the same model and data as training (from the flags after ``--``), restores the drill's
    checkpoint through ``ctx.reader`` inside ``ctx.restoring()``, and yields (step, loss) for
    ``ctx.steps`` steps.
    """
    args = build_parser().parse_args(list(ctx.argv))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    trainer = Trainer(args)
    with ctx.restoring():
        trainer.load(ctx.reader, ctx.checkpoint_id)
    for _ in range(ctx.steps):
        loss = trainer.step()
        yield trainer.state.progress.step, loss


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, read the configuration, and train. A configuration that does not load is
    one line from rank 0 and exit status 2 on every rank, before any process group or model."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.config = load_config(args.config)
    except (TierstoreError, OSError, ValueError) as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_gpt.py: error: {one_line(str(exc))}", file=sys.stderr)
        else:  # torchrun stops the other ranks when one exits: let rank 0 say why first
            time.sleep(2)
        return 2
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
