"""A restarted trainer, as a fresh process: ``python -m tests.guarantees.restart_child CONFIG``.

It does what a training script does at start: ``load_config``, ``latest_committed``, ``dcp.load`` of
it, then its first save (the next step). It prints one JSON line: the id it restored, the tier it
read, the step, and the seconds from before ``load_config`` to the first save's return. tierstore's
log goes to stderr (WARNING and above, each record on one line), for the test to count.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from tierstore import TieredReader, TieredWriter, latest_committed, load_config


def main(config_path: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s", stream=sys.stderr)
    began = time.monotonic()
    config = load_config(config_path)
    checkpoint_id = latest_committed(config)
    assert checkpoint_id is not None, "nothing to restore"
    state = {"w": torch.zeros(1000), "step": -1}
    reader = TieredReader(config)
    dcp.load(state, storage_reader=reader, checkpoint_id=checkpoint_id)
    step = int(state["step"]) + 1
    dcp.save(
        {"w": torch.full((1000,), float(step)), "step": step},
        storage_writer=TieredWriter(config),
        checkpoint_id=f"step_{step:04d}",
    )
    seconds = time.monotonic() - began
    print(
        json.dumps({"restored": checkpoint_id, "tier": reader.chosen_tier, "step": step, "seconds": seconds})
    )


if __name__ == "__main__":
    main(sys.argv[1])
