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
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierstore import TieredReader, TieredWriter, latest_committed, load_config
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


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step_no: int) -> dict[str, object]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step_no}


def write_config(work: Path, endpoint: str) -> Path:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="demo-checkpoints")
    config = {
        "namespace": "quickstart",
        "tiers": [
            {"name": "ram", "type": "memory", "path": f"/dev/shm/tierstore-demo-{os.getpid()}"},
            {"name": "nvme", "type": "local", "path": str(work / "nvme")},
            {
                "name": "s3",
                "type": "s3",
                "url": "s3://demo-checkpoints/runs",
                "endpoint_url": endpoint,
            },
        ],
    }
    path = work / "tierstore.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(work: Path, endpoint: str) -> None:
    path = write_config(work, endpoint)
    cfg = load_config(path)
    print(f"configuration: {path}")
    print(Path(path).read_text())
    torch.manual_seed(0)
    model, optimizer = make_model()

    with step("train 20 steps, dcp.save every 10 to the fastest tier (ram)"):
        for step_no in (10, 20):
            loss = train(model, optimizer, 10)
            dcp.save(
                state_of(model, optimizer, step_no),
                storage_writer=TieredWriter(cfg),
                checkpoint_id=f"step_{step_no:06d}",
            )
            print(f"   step {step_no}: loss {loss:.4f}, saved step_{step_no:06d} to ram")

    with step("train 10 more, dcp.async_save (the trainer is free as soon as it returns)"):
        loss = train(model, optimizer, 10)
        state = state_of(model, optimizer, 30)
        future = dcp.async_save(
            state, storage_writer=TieredWriter(cfg), checkpoint_id="step_000030"
        )
        with torch.no_grad():  # e.g. an evaluation pass overlaps the save
            model(torch.randn(32, 256))
        future.result()
        print(f"   step 30: loss {loss:.4f}, committed step_000030 in ram")

    with step("the same checkpoint straight to durable storage: TieredWriter(cfg, tier='s3')"):
        dcp.save(state, storage_writer=TieredWriter(cfg, tier="s3"), checkpoint_id="step_000030")
        print("   step_000030 is now committed in ram and in s3")

    with step("tierstore ls"):
        tierstore_cli(["--config", str(path), "ls"])

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for title in ("restore the latest checkpoint (fastest tier: ram)", "restore again"):
        with step(title):
            fresh, fresh_opt = make_model()
            state = state_of(fresh, fresh_opt, 0)
            ckpt = latest_committed(cfg)
            reader = TieredReader(cfg)
            dcp.load(state, storage_reader=reader, checkpoint_id=ckpt)
            set_state_dict(
                fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            same = all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
            print(f"   loaded {ckpt} (step {state['step']}) from tier '{reader.chosen_tier}'")
            print(f"   model identical to the one saved: {same}")
        if title.startswith("restore the latest"):
            with step("simulate losing host memory: delete step_000030's marker in ram"):
                make_tier(cfg.tier("ram"), namespace=cfg.namespace, node=0).delete(
                    marker_path("step_000030")
                )
                print("   without its marker the ram copy no longer exists for tierstore")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="   %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the embedded S3 server's access log
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
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(f"/dev/shm/tierstore-demo-{os.getpid()}", ignore_errors=True)
    print(f"\ndone in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
