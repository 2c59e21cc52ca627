"""Under torchrun: save a copy of a checkpoint whose optimizer state was dropped (a drill must catch it).

``drop_optimizer_state.py CONFIG SOURCE_ID NEW_ID TIER``: restores SOURCE_ID into the example's
training state, empties AdamW's moments, and saves the result as NEW_ID into TIER. Everything else
(model, schedule, progress, RNG streams) is as saved, so only the optimizer can explain a difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_gpt import Trainer, build_parser, setup_distributed

from tierstore import TieredReader, TieredWriter, load_config


def main() -> None:
    config_path, source, new_id, tier = sys.argv[1:5]
    setup_distributed()
    trainer = Trainer(build_parser().parse_args(["--config", config_path, "--steps", "200"]))
    config = load_config(config_path)
    trainer.load(TieredReader(config), source)
    trainer.state.optimizer.state.clear()
    dcp.save({"train": trainer.state}, storage_writer=TieredWriter(config, tier=tier), checkpoint_id=new_id)


if __name__ == "__main__":
    main()
