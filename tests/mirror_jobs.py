"""Jobs for the peer-mirror tests: simulated nodes (one memory root per node, one host name per node),
real ranks (``torch.multiprocessing``, gloo on loopback). Each function runs in a spawned rank."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, config_from_dict
from tierstore.topology import HOST_VARIABLE


def mirror_config(
    root: Path, *, lower: Sequence[str] = ("local", "shared"), keep: int = 2, **mirror: Any
) -> Config:
    """A memory tier (``{node}`` paths, mirrored) above node-local and job-wide tiers."""
    tiers: list[dict[str, Any]] = [
        {
            "name": "memory",
            "type": "memory",
            "path": f"{root}/mem/{{node}}",
            "keep": keep,
            "mirror": mirror or True,
        }
    ]
    for kind in lower:
        node = "/{node}" if kind == "local" else ""
        tiers.append({"name": kind, "type": kind, "path": f"{root}/{kind}{node}"})
    return config_from_dict({"tiers": tiers}, check_paths=False)


def memory_root(root: Path, node: int) -> Path:
    """A simulated node's memory tier (its host memory)."""
    return root / "mem" / str(node)


def mirror_markers(root: Path, node: int, checkpoint_id: str) -> list[Path]:
    """The mirror markers ``node`` holds for ``checkpoint_id``."""
    return sorted(memory_root(root, node).glob(f".tierstore/mirror/{checkpoint_id}/*/mirror-node*"))


def shard_state(rank: int, step: int, size: int = 200_000) -> dict[str, Any]:
    """Rank ``rank``'s state: its own shard, a tensor every rank holds (saved once), a step."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    return {
        "model": {
            f"shard{rank}": torch.randn(size, generator=generator),
            "replicated": torch.arange(1000, dtype=torch.float64) * step,
        },
        "step": step,
    }


def blank_state(ranks: Sequence[int], size: int = 200_000) -> dict[str, Any]:
    """A state of zeros holding the shards of ``ranks`` (a resharded load may take several)."""
    model = {f"shard{r}": torch.zeros(size) for r in ranks}
    model["replicated"] = torch.zeros(1000, dtype=torch.float64)
    return {"model": model, "step": -1}


def become(node: int) -> None:
    """This rank runs on simulated node ``node``, a host of its own."""
    os.environ[HOST_VARIABLE] = f"sim-host-{node}"


def save_steps(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int, world: int, config: Config, layout: Sequence[int], steps: Sequence[int], mode: str, root: Path
) -> None:
    """Save ``steps`` (``sync``, ``thread`` or ``process``), then wait until every node's mirror
    of the last one has its marker."""
    node = layout[rank]
    become(node)
    writer = TieredWriter(config, node=node)
    for step in steps:
        state = shard_state(rank, step)
        if mode == "sync":
            dcp.save(state, storage_writer=writer, checkpoint_id=f"step_{step}")
            continue
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(
            state, storage_writer=writer, checkpoint_id=f"step_{step}", async_checkpointer_type=kind
        )
        for tensor in state["model"].values():
            tensor.add_(1000.0)  # the trainer moves on: the checkpoint must not see this
        future.result()
    # close() waits for the exchange, also in PROCESS mode, where it runs in DCP's checkpoint
    # process: after it, every node's mirror of the last save is there.
    writer.close()
    last = f"step_{steps[-1]}"
    held = {n: mirror_markers(root, n, last) for n in sorted(set(layout))}
    assert all(len(markers) == 1 for markers in held.values()), held
    dist.barrier()


def wait_for_mirrors(root: Path, nodes: list[int], checkpoint_id: str, timeout: float = 90) -> None:
    """Until every node of a multi-node job holds one mirror marker of ``checkpoint_id``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len(mirror_markers(root, n, checkpoint_id)) == 1 for n in nodes):
            return
        time.sleep(0.05)
    held = {n: mirror_markers(root, n, checkpoint_id) for n in nodes}
    raise AssertionError(f"mirrors of {checkpoint_id} not complete after {timeout}s: {held}")


def load_and_check(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int,
    world: int,
    config: Config,
    layout: Sequence[int],
    step: int,
    tier: str,
    saved_ranks: Sequence[int],
) -> None:
    """Restart on ``layout``: ``latest_committed`` names ``step``, and every rank loads the shards
    its new rank needs (all of them at world size 1) bit-exact from ``tier``."""
    node = layout[rank]
    become(node)
    checkpoint_id = latest_committed(config, node=node)
    assert checkpoint_id == f"step_{step}", checkpoint_id
    mine = list(saved_ranks) if world < len(saved_ranks) else [rank]
    target = blank_state(mine)
    reader = TieredReader(config, node=node)
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    assert reader.chosen_tier == tier, (reader.chosen_tier, tier)
    for saved in mine:
        expected = shard_state(saved, step)["model"][f"shard{saved}"]
        assert torch.equal(target["model"][f"shard{saved}"], expected), f"shard{saved} differs"
    assert torch.equal(target["model"]["replicated"], shard_state(0, step)["model"]["replicated"])
    assert target["step"] == step


BIG = 48 * 2**20
"""Elements of a shard big enough (192 MiB) that a mirror exchange lasts long enough to kill a peer."""


def save_and_linger(rank: int, world: int, store: str, config: Config, root: Path) -> None:
    """One rank of a job whose peer the test kills during the mirror exchange: save, wait for the
    exchange to end (mirrored, or failed and recorded), say so, then wait to be killed."""
    from tests.workers import init_group

    init_group(rank, world, store)
    become(rank)
    writer = TieredWriter(config, node=rank)
    try:
        dcp.save(shard_state(rank, 1, BIG), storage_writer=writer, checkpoint_id="step_1")
    except Exception as exc:  # noqa: BLE001 - the peer may die before DCP's last broadcast
        (root / f"save-error{rank}").write_text(str(exc))
    writer.wait_mirrored(120)
    (root / f"exchange-ended{rank}").touch()
    time.sleep(600)


def save_on_hosts(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int,
    world: int,
    config: Config,
    layout: Sequence[int],
    hosts: Sequence[str],
    sizes: Sequence[int] = (200_000,),
) -> None:
    """Save ``step_1``, ``step_2``, ... with shards of ``sizes``, rank ``r`` on node ``layout[r]``
    of host ``hosts[r]``, each time waiting for the exchange to end (however it ends)."""
    os.environ[HOST_VARIABLE] = hosts[rank]
    writer = TieredWriter(config, node=layout[rank])
    for step, size in enumerate(sizes, start=1):
        dcp.save(shard_state(rank, step, size), storage_writer=writer, checkpoint_id=f"step_{step}")
        assert writer.wait_mirrored(60)


SaveStep = tuple[str, int, int, dict[str, Any]]
"""One save of a plan: checkpoint id, the step whose state it holds, shard size, writer kwargs."""


def save_plan(rank: int, world: int, config: Config, layout: Sequence[int], plan: Sequence[SaveStep]) -> None:
    """Save each step of ``plan`` in turn, each time waiting for the exchange to end."""
    node = layout[rank]
    become(node)
    for checkpoint_id, step, size, kwargs in plan:
        writer = TieredWriter(config, node=node, **kwargs)
        dcp.save(shard_state(rank, step, size), storage_writer=writer, checkpoint_id=checkpoint_id)
        assert writer.wait_mirrored(60)
        writer.close()
    dist.barrier()


def check_latest(rank: int, world: int, config: Config, layout: Sequence[int], expected: str) -> None:
    """Every rank of a job on ``layout`` finds ``expected`` as the checkpoint to resume from."""
    node = layout[rank]
    become(node)
    found = latest_committed(config, node=node)
    assert found == expected, f"rank {rank} on node {node}: latest is {found}, expected {expected}"


def load_step(  # noqa: PLR0917 - torch.multiprocessing passes arguments by position
    rank: int,
    world: int,
    config: Config,
    layout: Sequence[int],
    checkpoint_id: str,
    expected: tuple[str, int] | None,
    size: int,
) -> None:
    """Load ``checkpoint_id`` (every saved rank's shard at world size 2): from tier ``expected[0]``
    with the state of step ``expected[1]``, or (``expected`` None) not at all."""
    node = layout[rank]
    become(node)
    target = blank_state([rank], size)
    reader = TieredReader(config, node=node)
    if expected is None:
        try:
            dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
        except CheckpointException as exc:  # DCP's wrapper of the reader's error
            assert "no tier holds a usable committed copy" in str(exc), exc
            return
        raise AssertionError(f"loaded {checkpoint_id} from {reader.chosen_tier}: expected none")
    dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
    tier, step = expected
    assert reader.chosen_tier == tier, (reader.chosen_tier, tier)
    wanted = shard_state(rank, step, size)["model"][f"shard{rank}"]
    assert target["step"] == step and torch.equal(target["model"][f"shard{rank}"], wanted)


def veto_on_rank_0(view: Any) -> str | None:
    """A commit gate that refuses on rank 0 only (the other ranks have written by then)."""
    return "refused on rank 0" if view.rank == 0 else None


def save_then_fail_an_overwrite(rank: int, world: int, config: Config, size: int) -> None:
    """Save ``step_1`` (mirrored), then an overwrite of it that rank 0's gate vetoes."""
    become(rank)
    writer = TieredWriter(config, node=rank)
    dcp.save(shard_state(rank, 1, size), storage_writer=writer, checkpoint_id="step_1")
    vetoed = TieredWriter(config, node=rank, overwrite=True, commit_gate=veto_on_rank_0)
    try:
        dcp.save(shard_state(rank, 2, size), storage_writer=vetoed, checkpoint_id="step_1")
    except CheckpointException as exc:
        assert "refused on rank 0" in str(exc), exc
    else:
        raise AssertionError("the vetoed overwrite committed")
    assert writer.wait_mirrored(60) and vetoed.wait_mirrored(60)
    dist.barrier()


def overwrite_back_to_back(rank: int, world: int, config: Config, size: int) -> None:
    """A big save, then three small saves of one id, each replacing the last (``overwrite=True``):
    their exchanges queue behind the big one's and find the generations they were to send
    already replaced by the time they run."""
    become(rank)
    writer = TieredWriter(config, node=rank, overwrite=True)
    dcp.save(shard_state(rank, 9, size), storage_writer=writer, checkpoint_id="big")
    for step in (1, 2, 3):
        dcp.save(shard_state(rank, step, 2000), storage_writer=writer, checkpoint_id="latest")
    assert writer.wait_mirrored(120)
    dist.barrier()
