"""tierstore quickstart: train a small model, checkpoint it through the tiers, restore it.

Runs on an embedded default, no external service needed: a memory tier (tmpfs), a local-disk tier and
an S3 tier served by moto's S3 server, started here on 127.0.0.1 with a free port. Prints each step
and how long it took. ``python examples/quickstart.py [--keep]`` (``make demo``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierstore import Config, TieredReader, TieredWriter, latest_committed, load_config
from tierstore.cli import main as tierstore_cli
from tierstore.ids import marker_path
from tierstore.testing import embedded_s3
from tierstore.tiers import make_tier


@contextlib.contextmanager
def step(title: str) -> Iterator[None]:
    """Print a step and how long it took."""
    print(f"\n== {title}")
    start = time.perf_counter()
    yield
    print(f"   ({(time.perf_counter() - start) * 1000:.0f} ms)")


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = torch.randn(32, 256)
        loss = (model(batch) - batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step_no: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step_no}


def write_config(work: Path, endpoint: str) -> Path:
    import boto3  # type: ignore[import-untyped]

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="demo-checkpoints")
    ram = f"/dev/shm/tierstore-demo-{os.getpid()}"
    config = {
        "namespace": "quickstart",
        "tiers": [
            {"name": "ram", "type": "memory", "path": ram, "keep": 2},
            {"name": "nvme", "type": "local", "path": str(work / "nvme"), "keep": 3},
            {
                "name": "s3",
                "type": "s3",
                "url": "s3://demo-checkpoints/runs",
                "endpoint_url": endpoint,
                "keep": 10,
            },
        ],
        "promote": {"every": 2},
    }
    path = work / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def restore(cfg: Config, checkpoint_id: str, expected: dict[str, torch.Tensor]) -> None:
    fresh, fresh_opt = make_model()
    state = state_of(fresh, fresh_opt, 0)
    reader = TieredReader(cfg)
    dcp.load(state, storage_reader=reader, checkpoint_id=checkpoint_id)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
    print(f"   loaded {checkpoint_id} (step {state['step']}) from tier '{reader.chosen_tier}'")
    print(f"   model identical to the one saved: {same}")


def run(work: Path, endpoint: str) -> None:
    path = write_config(work, endpoint)
    cfg = load_config(path)
    print(f"configuration: {path}")
    print(Path(path).read_text())
    torch.manual_seed(0)
    model, optimizer = make_model()

    with step("train 30 steps, dcp.save every 10 to the fastest tier (ram)"):
        for step_no in (10, 20, 30):
            loss = train(model, optimizer, 10)
            checkpoint_id = f"step_{step_no:06d}"
            dcp.save(
                state_of(model, optimizer, step_no),
                storage_writer=TieredWriter(cfg),
                checkpoint_id=checkpoint_id,
            )
            print(f"   step {step_no}: loss {loss:.4f}, committed {checkpoint_id} in ram")

    with step("train 10 more, dcp.async_save (the trainer is free as soon as it returns)"):
        loss = train(model, optimizer, 10)
        future = dcp.async_save(
            state_of(model, optimizer, 40), storage_writer=TieredWriter(cfg), checkpoint_id="step_000040"
        )
        with torch.no_grad():  # e.g. an evaluation pass overlaps the save
            model(torch.randn(32, 256))
        assert isinstance(future, Future)  # THREAD mode without a stager returns a Future
        future.result()
        print(f"   step 40: loss {loss:.4f}, committed step_000040 in ram")
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    with step("tierstore ls"):
        tierstore_cli(["--config", str(path), "ls"])

    with step("tierstore promote --once: copy down the tiers (every 2nd to s3), then retention"):
        tierstore_cli(["--config", str(path), "promote", "--once"])

    with step("tierstore ls"):
        tierstore_cli(["--config", str(path), "ls"])

    with step("restore the latest checkpoint: the fastest tier holding it (ram)"):
        latest = latest_committed(cfg)
        assert latest is not None
        restore(cfg, latest, saved)

    with step(f"simulate losing host memory: delete {latest}'s marker in ram"):
        make_tier(cfg.tier("ram"), namespace=cfg.namespace, node=0).delete(marker_path(latest))
        print("   without its marker the ram copy no longer exists for tierstore")

    with step("restore again: the next tier holding it (nvme)"):
        restore(cfg, latest, saved)

    with step("tierstore advise --mtbf 1h --restart 1m: the save interval from the measured stalls"):
        tierstore_cli(["--config", str(path), "advise", "--mtbf", "1h", "--restart", "1m"])

    with step("train 5 more; the run's final checkpoint straight to s3 (tier='s3')"):
        train(model, optimizer, 5)
        dcp.save(
            state_of(model, optimizer, 45),
            storage_writer=TieredWriter(cfg, tier="s3"),
            checkpoint_id="step_000045",
        )
        tierstore_cli(["--config", str(path), "ls"])


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="   %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the embedded S3 server's access log
    # the promoter's promoted/deleted events, and which checkpoint and tier a restore takes
    for name in ("tierstore.promote.sidecar", "tierstore.dcp.latest", "tierstore.dcp.reader"):
        logging.getLogger(name).setLevel(logging.INFO)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tierstore-demo-"))
    started = time.perf_counter()
    try:
        with embedded_s3() as endpoint:
            print(f"embedded S3 (moto) at {endpoint}")
            run(work, endpoint)
    finally:
        ram = f"/dev/shm/tierstore-demo-{os.getpid()}"
        if args.keep:
            print(
                f"\nkept the memory and disk tiers' checkpoints in {ram} and {work} (S3 was embedded: gone)"
            )
        else:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)
            keep = "--keep keeps them (make demo DEMO_ARGS=--keep)"
            print(f"\nremoved the demo's checkpoints ({ram}, {work}); {keep}")
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
