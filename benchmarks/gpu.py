"""The CUDA path: tierstore's async save of a GPU state against torch's best pinned-memory stager.

``python benchmarks/gpu.py [--size 4GiB] [--rounds 3] [--device cuda:0] [--out DIR]`` on a machine
with a GPU (about 2-4 minutes for 4 GiB). Each round saves the same GPU state with every side, back
to back, in a rotating order, each waited for to its commit before the next:

* **torch best**: one ``DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
  use_async_staging=True, use_non_blocking_copy=True))`` kept for the run (torchtitan's recipe) with
  torch's ``FileSystemWriter`` into tmpfs: ``async_save`` returns, ``staging_completion`` (the stall:
  the state may change), ``upload_completion`` (committed);
* **tierstore**: ``TieredWriter(cfg)`` into a memory tier on the same tmpfs (the stall is
  ``async_save``'s return, the copy inside it);
* **tierstore overlapped**: ``TieredWriter(cfg, overlap=True)``, timed like torch best.

Then the last tierstore checkpoint is restored onto the GPU through ``TieredReader`` and compared
with the state bit for bit. Targets (issue 39): tierstore's stall <= 1.0 x torch best's stall, the
overlapped save's return <= 0.1 x that stall. ``--cpu`` runs the same on CPU tensors (a dry run of
the script; the ratios then say nothing about GPUs). Results: a table on stdout and ``gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.stalls import SaveTimes, time_async_save
from tierstore import TieredReader, TieredWriter
from tierstore.config import config_from_dict
from tierstore.units import parse_size

TARGETS = {"stall / torch best stall": 1.0, "overlapped return / torch best stall": 0.1}


def make_state(size: int, tensors: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``size`` bytes in all on ``device``, seeded."""
    generator = torch.Generator(device=device).manual_seed(0)
    each = size // tensors // 4
    return {f"t{i:03d}": torch.rand(each, generator=generator, device=device) for i in range(tensors)}


class Sides:
    """Every side, with what it keeps for the whole run (stager, writers) and where it writes."""

    def __init__(self, root: Path, state: dict[str, torch.Tensor], *, cuda: bool) -> None:
        self.root, self.state = root, state
        self.config = config_from_dict(
            {"tiers": [{"name": "ram", "type": "memory", "path": str(root / "ram")}]}
        )
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
        )
        self.stager = DefaultStager(options)
        self.writer = TieredWriter(self.config)
        self.overlapped = TieredWriter(self.config, overlap=True)
        self.saves = 0
        self.last_id = ""

    def torch_best(self) -> SaveTimes:
        target = self.root / "torch"
        times = time_async_save(
            self.state, storage_writer=FileSystemWriter(str(target)), async_stager=self.stager
        )
        shutil.rmtree(target)
        return times

    def tierstore(self, writer: TieredWriter) -> SaveTimes:
        self.saves += 1
        self.last_id = f"step_{self.saves:04d}"
        return time_async_save(self.state, storage_writer=writer, checkpoint_id=self.last_id)

    def close(self) -> None:
        self.stager.close()
        self.writer.close()
        self.overlapped.close()


def restore_is_exact(sides: Sides, device: torch.device) -> bool:
    """The last tierstore checkpoint, loaded onto ``device``, equals the state bit for bit."""
    loaded = {name: torch.empty_like(t) for name, t in sides.state.items()}
    dcp.load(loaded, storage_reader=TieredReader(sides.config), checkpoint_id=sides.last_id)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return all(torch.equal(loaded[name], sides.state[name]) for name in sides.state)


def run(size: int, tensors: int, rounds: int, device: torch.device, root: Path) -> dict[str, Any]:
    """Every side ``rounds`` times, rotating; medians, ratios and the restore check."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    state = make_state(size, tensors, device)
    sides = Sides(root, state, cuda=cuda)
    runs = {
        "torch best": sides.torch_best,
        "tierstore": lambda: sides.tierstore(sides.writer),
        "tierstore overlapped": lambda: sides.tierstore(sides.overlapped),
    }
    times: dict[str, list[SaveTimes]] = {name: [] for name in runs}
    try:
        for save in runs.values():  # a first save of each side makes its buffers: not counted
            save()
        for index in range(rounds):
            order = list(runs)[index % len(runs) :] + list(runs)[: index % len(runs)]
            for name in order:
                times[name].append(runs[name]())
        exact = restore_is_exact(sides, device)
    finally:
        sides.close()
    median = {
        name: {
            field: statistics.median(getattr(t, field) for t in ts)
            for field in ("returned", "staged", "committed")
        }
        for name, ts in times.items()
    }
    best = median["torch best"]["staged"]
    ratios = {
        "stall / torch best stall": median["tierstore"]["staged"] / best,
        "overlapped stall / torch best stall": median["tierstore overlapped"]["staged"] / best,
        "overlapped return / torch best stall": median["tierstore overlapped"]["returned"] / best,
        "commit / torch best commit": median["tierstore"]["committed"] / median["torch best"]["committed"],
    }
    return {
        "device": str(device),
        "name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "rounds": rounds,
        "median_seconds": median,
        "ratios": ratios,
        "targets": {
            name: {"at_most": target, "met": ratios[name] <= target} for name, target in TARGETS.items()
        },
        "restore_bit_exact": exact,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GiB", help="bytes of GPU state (default 4GiB; --cpu: 64MiB)")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dir", default="/dev/shm", help="the tmpfs both sides write into")
    parser.add_argument("--out", default="bench-results", help="where gpu.json goes")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors: a dry run of the script")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --cpu for a dry run")
    device = torch.device("cpu" if args.cpu else args.device)
    size = parse_size("64MiB" if args.cpu and args.size == "4GiB" else args.size)
    root = Path(tempfile.mkdtemp(prefix="tierstore-gpu-", dir=args.dir))
    started = time.perf_counter()
    try:
        result = run(size, args.tensors, args.rounds, device, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu.json").write_text(json.dumps(result, indent=1))
    print(f"{result['name']} ({result['device']}), {result['bytes'] / 2**30:.2f} GiB, {args.rounds} rounds")
    for name, seconds in result["median_seconds"].items():
        times = f"return {seconds['returned']:.3f} s  stall {seconds['staged']:.3f} s"
        print(f"  {name:22} {times}  commit {seconds['committed']:.3f} s")
    for name, ratio in result["ratios"].items():
        target = TARGETS.get(name)
        verdict = (
            "" if target is None else f"  (target <= {target}: {'met' if ratio <= target else 'MISSED'})"
        )
        print(f"  {name:38} {ratio:.2f}{verdict}")
    print(f"  restore onto {result['device']}: {'bit-exact' if result['restore_bit_exact'] else 'DIFFERS'}")
    return 0 if result["restore_bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
