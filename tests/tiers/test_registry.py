"""A tier type is one module plus one registration: the tests' ``dict`` type works end to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
import torch.distributed.checkpoint as dcp

from tests.tiers.dict_tier import DictTier, DictTierConfig
from tests.training import Trainer, assert_same, fresh_target
from tierstore import TieredReader, TieredWriter, latest_committed
from tierstore.config import Config, load_config
from tierstore.errors import ConfigError
from tierstore.tiers import RetryHook, TierConfig, register, tier_types


def test_the_registered_type_is_known_to_the_configuration(tmp_path: Path) -> None:
    assert {"memory", "local", "shared", "s3", "dict"} <= set(tier_types())
    path = tmp_path / "t.yaml"
    path.write_text("tiers:\n  - {name: mine, type: dict, store: abc, keep: 2}\n")
    config = load_config(path)
    assert isinstance(config.tiers[0], DictTierConfig) and config.tiers[0].store == "abc"
    assert isinstance(config.make_tiers(node=0)[0], DictTier)
    path.write_text("tiers:\n  - {name: mine, type: dict, colour: red}\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.colour: unknown key 'colour'"):
        load_config(path)


def test_a_second_model_cannot_take_a_registered_name() -> None:
    class Impostor(DictTierConfig):
        type: Literal["dict"]

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)

    class Untyped(TierConfig):
        def build(self, *, namespace: str | None, node: int, on_retry: RetryHook | None = None) -> DictTier:
            raise NotImplementedError

    with pytest.raises(ValueError, match="Literal"):
        register(Untyped)


def test_dcp_round_trip_through_the_registered_type(make_config: Callable[..., Config]) -> None:
    config = make_config("dict")
    trainer = Trainer(seed=4)
    trainer.train(2)
    dcp.save(trainer.state(), storage_writer=TieredWriter(config), checkpoint_id="step_000002")
    trainer.train(1)
    expected = trainer.state()
    dcp.async_save(expected, storage_writer=TieredWriter(config), checkpoint_id="step_000003").result()
    assert latest_committed(config) == "step_000003"
    target, state = fresh_target()
    reader = TieredReader(config, verify=True)
    dcp.load(state, storage_reader=reader, checkpoint_id="step_000003")
    target.restore(state)
    assert_same(expected, target.state())
    assert reader.chosen_tier == "dict"
