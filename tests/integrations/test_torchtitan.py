"""tierstore as torchtitan's checkpointer, driven the way torchtitan's trainer drives it: its own
``ModelWrapper``, ``OptimizersContainer`` and ``LRSchedulersContainer`` on CPU, 2 gloo ranks, the
manager built from its ``Config`` with the trainer's ``build()`` arguments. ``make titan`` runs this
with torchtitan installed (``.venv-titan``, where a skip would be a failure); elsewhere it is skipped."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import yaml

if os.environ.get("TIERSTORE_TITAN_LANE"):  # make titan: a torchtitan that does not import fails the lane
    import torchtitan  # noqa: F401
else:
    pytest.importorskip("torchtitan")

from tests.workers import run_ranks

STEPS = 10
INTERVAL = 3


class TrainState:
    """The trainer's own Stateful (torchtitan's Trainer saves ``step`` as ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def trainer(config_path: str, **fields: Any) -> tuple[Any, ...]:
    """What torchtitan's Trainer builds: model, optimizers, lr schedulers, then the checkpointer."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from tierstore.integrations.torchtitan import TieredCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim_config = default_adamw(lr=1e-2)
    optim_config.implementation = "for-loop"
    optimizers = optim_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    state = TrainState()
    checkpoint_config = TieredCheckpointManager.Config(
        enable=True, tierstore_config=config_path, interval=INTERVAL, **fields
    )
    checkpointer = checkpoint_config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder="",
    )
    assert isinstance(checkpointer, TieredCheckpointManager)
    return model, optimizers, schedulers, state, checkpointer


class Leg(NamedTuple):
    """One job of a run: its tierstore config, where it leaves its final state, the step it is
    killed after (``STEPS``: it finishes), the ``load_step`` it starts with, checkpoint fields."""

    config: str
    out: str
    stop_at: int = STEPS
    load_step: int = -1
    fields: dict[str, Any] = {}  # never mutated


def train(rank: int, world: int, leg: Leg) -> None:
    """The trainer's loop: load, then per step train, wait for staging, step, save; ``stop_at`` < STEPS
    is the job killed after that step (no close, no final save)."""
    stop_at = leg.stop_at
    model, optimizers, schedulers, state, checkpointer = trainer(leg.config, **leg.fields)
    checkpointer.load(step=leg.load_step)
    while state.step < stop_at:
        state.step += 1
        data = torch.Generator().manual_seed(1000 * state.step + rank)
        x = torch.randn(4, 8, generator=data)
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():  # data parallel by hand: average the gradients
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        checkpointer.save(state.step, last_step=state.step == STEPS)
    if stop_at < STEPS:
        checkpointer.maybe_wait_for_saving()  # killed after this: its committed saves are what a resume sees
    else:
        checkpointer.close()
    torch.save(
        {"step": state.step, "model": model.state_dict(), "optim": optimizers.state_dict()},
        f"{leg.out}-{rank}.pt",
    )


def write_config(tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], name: str) -> str:
    specs = tier_specs("memory", "local")
    for spec in specs:
        spec["path"] = spec["path"].replace(str(tmp_path), str(tmp_path / name))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"tiers": specs, "namespace": name}))
    return str(path)


def assert_same(one: dict[str, Any], other: dict[str, Any], where: str = "") -> None:
    assert one.keys() == other.keys(), where
    for key, value in one.items():
        if isinstance(value, dict):
            assert_same(value, other[key], f"{where}.{key}")
        elif isinstance(value, torch.Tensor):
            assert value.dtype == other[key].dtype and torch.equal(value, other[key]), f"{where}.{key}"
        else:
            assert value == other[key], f"{where}.{key}"


def ids(config_path: str, tier: str) -> list[str]:
    from tierstore import load_config

    config = load_config(config_path)
    return sorted(i for i in config.make_tier(tier, node=0).list_dir() if i.startswith("step_"))


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_killed_and_resumed_run_is_bit_exact(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]], async_mode: str
) -> None:
    full = {"async_mode": async_mode, "last_save_model_only": False}
    straight = write_config(tmp_path, tier_specs, "straight")
    run_ranks(train, 2, tmp_path, Leg(straight, str(tmp_path / "straight"), fields=full))
    resumed = write_config(tmp_path, tier_specs, "resumed")
    run_ranks(train, 2, tmp_path, Leg(resumed, str(tmp_path / "killed"), stop_at=7, fields=full))
    assert ids(resumed, "memory") == ["step_00000003", "step_00000006"]
    run_ranks(train, 2, tmp_path, Leg(resumed, str(tmp_path / "resumed"), fields=full))
    for rank in range(2):
        expected = torch.load(tmp_path / f"straight-{rank}.pt")
        got = torch.load(tmp_path / f"resumed-{rank}.pt")
        assert got["step"] == STEPS
        assert_same(got["model"], expected["model"], "model")
        assert_same(got["optim"], expected["optim"], "optim")
    # the final save went straight into the last tier (durable_last_save), full training state
    assert "step_00000010" in ids(resumed, "local")


def test_load_step_restores_that_step(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]
) -> None:
    """``load_step=3`` after a run that saved 3, 6, 9: training continues from 3 and ends where a
    straight run ends (steps 6 and 9 are saved again, over the old ones)."""
    full = {"last_save_model_only": False}
    straight = write_config(tmp_path, tier_specs, "straight")
    run_ranks(train, 2, tmp_path, Leg(straight, str(tmp_path / "straight"), fields=full))
    run_ranks(train, 2, tmp_path, Leg(straight, str(tmp_path / "rewound"), load_step=3, fields=full))
    for rank in range(2):
        expected = torch.load(tmp_path / f"straight-{rank}.pt")
        got = torch.load(tmp_path / f"rewound-{rank}.pt")
        assert_same(got["model"], expected["model"], "model")
        assert_same(got["optim"], expected["optim"], "optim")


def load_model_only(rank: int, world: int, config_path: str, out: str) -> None:
    """Resuming a finished model-only run is refused; ``load_step`` at its step loads the model."""
    model, _optimizers, _schedulers, state, checkpointer = trainer(config_path)
    with pytest.raises(ValueError, match="holds only the model"):
        checkpointer.load(step=-1)
    assert checkpointer.load(step=STEPS) and state.step == 0, "the model only: no training state"
    torch.save(model.state_dict(), f"{out}-{rank}.pt")
    checkpointer.close()


def test_last_save_model_only_in_export_dtype(
    tmp_path: Path, tier_specs: Callable[..., list[dict[str, Any]]]
) -> None:
    from tierstore import TieredReader, load_config

    config_path = write_config(tmp_path, tier_specs, "export")
    fields = {"last_save_model_only": True, "export_dtype": "bfloat16"}
    run_ranks(train, 2, tmp_path, Leg(config_path, str(tmp_path / "trained"), fields=fields))
    assert "step_00000010-model" in ids(config_path, "local"), "durable: written into the last tier"
    reader = TieredReader(load_config(config_path))
    reader.reset("step_00000010-model")
    saved = reader.read_metadata().state_dict_metadata
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"], "only the model"
    trained = torch.load(tmp_path / "trained-0.pt")["model"]
    run_ranks(load_model_only, 2, tmp_path, config_path, str(tmp_path / "loaded"))
    loaded = torch.load(tmp_path / "loaded-0.pt")
    for key, value in trained.items():
        assert torch.equal(loaded[key], value.to(torch.bfloat16).float()), key


def test_config_refuses_what_tierstore_cannot_store() -> None:
    from tierstore.integrations.torchtitan import TieredCheckpointManager

    with pytest.raises(ValueError, match="last_save_in_hf"):
        TieredCheckpointManager.Config(last_save_in_hf=True)
    with pytest.raises(ValueError, match="async_mode"):
        TieredCheckpointManager.Config(async_mode="sometimes")  # type: ignore[arg-type]


def test_torchtitans_command_line_reaches_the_new_field() -> None:
    """torchtitan parses its command line with tyro over the config its registry returns: with
    ``TieredCheckpointManager.Config`` there, ``--checkpoint.tierstore-config`` and the usual fields work."""
    import dataclasses

    import tyro
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from tierstore.integrations.torchtitan import TieredCheckpointManager

    # the shape of torchtitan's Trainer.Config's checkpoint field (made here: tyro resolves its type)
    trainer_config = dataclasses.make_dataclass(
        "TrainerConfig", [("checkpoint", BaseCheckpointManager.Config)], kw_only=True
    )
    default = trainer_config(checkpoint=TieredCheckpointManager.Config(interval=7))
    args = ["--checkpoint.tierstore-config", "/etc/tierstore.yaml", "--checkpoint.async-mode", "async"]
    parsed = tyro.cli(trainer_config, args=args, default=default).checkpoint
    assert isinstance(parsed, TieredCheckpointManager.Config)
    assert (parsed.tierstore_config, parsed.interval, parsed.async_mode) == (
        "/etc/tierstore.yaml",
        7,
        "async",
    )
